"""``epd bench chaos``: steady load through a live ``epd serve`` while its workers are killed, stopped and
its Redis restarted; every answer is checked against ``generate()``. See ``run.py``."""
