"""Fused int8 kernels (and bf16's finite check) in C, compiled on first use with the system C compiler and
called via ctypes.

Why: eager torch quantises int8 in six passes over float32 scratch and dequantises in three, so the
codec, not the wire, bounded int8 transfers. The kernels below do each block in two sweeps (an integer
max for the scale, then scale-round-store), reading the bf16/float32 input once from memory, with the
same float32 arithmetic as the eager code, so their output is bit-identical to it
(tests/unit/test_kv_fast_paths.py checks this).

Why C through ctypes and not a torch extension or ``torch.compile``: one small file builds with no
torch headers and no compile step at engine start, and ctypes releases the GIL for the call, so the
sender's encoder threads run kernels in parallel. The shared object is cached per source and CPU
(``$EPD_KERNEL_CACHE``, default ~/.cache/epd/kernels). Without a compiler, or with
``EPD_NATIVE_KERNELS=0``, ``load()`` returns None and the codecs use their eager torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch (inputs are finite) */
    uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}
#define TINY 1.17549435e-38f
#define MAXH 1024

/* x [n, bs, h, d] bf16 (x_bf16 = 1) or float32 -> q int8 (same order), scales float32 [n, h].
   Returns 0, or 1 when x holds NaN/inf (the outputs are then unspecified). */
int kv_int8_encode(const void *x, int x_bf16, int64_t n, int64_t bs, int64_t h, int64_t d,
                   int8_t *q, float *scales) {
    if (h > MAXH) return 2;
    float inv[MAXH];
    uint32_t mx[MAXH];
    int64_t tile = bs * h * d;
    for (int64_t b = 0; b < n; b++) {
        int64_t base = b * tile;
        /* |x| as integer bits orders like |x| for finite values; NaN/inf sort above them all.
           One pass over the tile in memory order (token, head, dim): a head-major pass strides by
           h*d, which is slow on inputs not already in cache. */
        for (int64_t hh = 0; hh < h; hh++) mx[hh] = 0;
        for (int64_t t = 0; t < bs; t++) {
            for (int64_t hh = 0; hh < h; hh++) {
                int64_t row = base + (t * h + hh) * d;
                uint32_t m = 0;
                if (x_bf16) {
                    const uint16_t *p = (const uint16_t *)x + row;
                    uint16_t mm = 0;
                    for (int64_t j = 0; j < d; j++) { uint16_t a = p[j] & 0x7FFFu; mm = a > mm ? a : mm; }
                    m = (uint32_t)mm << 16;
                } else {
                    const uint32_t *p = (const uint32_t *)x + row;
                    for (int64_t j = 0; j < d; j++) { uint32_t a = p[j] & 0x7FFFFFFFu; m = a > m ? a : m; }
                }
                mx[hh] = m > mx[hh] ? m : mx[hh];
            }
        }
        for (int64_t hh = 0; hh < h; hh++) {
            uint32_t m = mx[hh];
            if (m >= 0x7F800000u) return 1;
            float amax; memcpy(&amax, &m, 4);
            float s = amax / 127.0f;
            if (s < TINY) s = TINY;
            scales[b * h + hh] = s;
            inv[hh] = 1.0f / s;
        }
        for (int64_t t = 0; t < bs; t++) {
            for (int64_t hh = 0; hh < h; hh++) {
                int64_t row = base + (t * h + hh) * d;
                float r = inv[hh];
                int8_t *o = q + row;
                if (x_bf16) {
                    const uint16_t *p = (const uint16_t *)x + row;
                    for (int64_t j = 0; j < d; j++) o[j] = (int8_t)(int32_t)rintf(bf16_to_f32(p[j]) * r);
                } else {
                    const float *p = (const float *)x + row;
                    for (int64_t j = 0; j < d; j++) o[j] = (int8_t)(int32_t)rintf(p[j] * r);
                }
            }
        }
    }
    return 0;
}

/* 1 when none of the n bf16 values at x is NaN or inf (exponent bits all ones: (v & 0x7FFF) >= 0x7F80),
   else 0. One integer max pass at memory speed (vectorised by the compiler). */
int kv_bf16_all_finite(const uint16_t *x, int64_t n) {
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) { uint16_t a = x[i] & 0x7FFFu; m = a > m ? a : m; }
    return m < 0x7F80u;
}

/* q int8 [n, bs, h, d], scales float32 [n, h] -> out [n, bs, h, d] bf16 (out_bf16 = 1) or float32 */
void kv_int8_decode(const int8_t *q, const float *scales, int64_t n, int64_t bs, int64_t h, int64_t d,
                    void *out, int out_bf16) {
    for (int64_t b = 0; b < n; b++) {
        for (int64_t t = 0; t < bs; t++) {
            for (int64_t hh = 0; hh < h; hh++) {
                int64_t row = ((b * bs + t) * h + hh) * d;
                float s = scales[b * h + hh];
                const int8_t *p = q + row;
                if (out_bf16) {
                    uint16_t *o = (uint16_t *)out + row;
                    for (int64_t j = 0; j < d; j++) o[j] = f32_to_bf16((float)p[j] * s);
                } else {
                    float *o = (float *)out + row;
                    for (int64_t j = 0; j < d; j++) o[j] = (float)p[j] * s;
                }
            }
        }
    }
}
"""

MAX_HEADS = 1024
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, disabled, or the build failed; logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib = _build_and_load()
            _tried = True
    return _lib


def load_in_background() -> None:
    """Build or load the kernels on a daemon thread now, so the first int8 chunk does not wait for
    the compiler (a fraction of a second, once per machine; later processes only load the file)."""
    if not _tried:
        threading.Thread(target=load, name="kv-native-kernels", daemon=True).start()


def _cache_dir() -> Path:
    root = os.environ.get("EPD_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "epd" / "kernels"


def _cpu_key() -> str:
    """-march=native code only runs on a CPU with the same features: key the cache on them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build_and_load() -> ctypes.CDLL | None:
    if os.environ.get("EPD_NATIVE_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: KV codecs use their eager torch kernels")
        return None
    key = hashlib.sha256((SOURCE + " ".join(_FLAGS) + _cpu_key()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kvcodecs-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "kvcodecs.c"
                src.write_text(SOURCE)
                out = Path(tmp) / "kvcodecs.so"
                subprocess.run([cc, *_FLAGS, "-o", str(out), str(src), "-lm"], check=True, capture_output=True,
                               timeout=120)
                os.replace(out, target)  # atomic: concurrent builders each install a complete file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("building the native KV codec kernels failed (%s %s); using eager torch kernels",
                    exc, detail.decode(errors="replace")[:500])
        return None
    i64 = ctypes.c_int64
    lib.kv_int8_encode.argtypes = (ctypes.c_void_p, ctypes.c_int, i64, i64, i64, i64, ctypes.c_void_p,
                                   ctypes.c_void_p)
    lib.kv_int8_encode.restype = ctypes.c_int
    lib.kv_int8_decode.argtypes = (ctypes.c_void_p, ctypes.c_void_p, i64, i64, i64, i64, ctypes.c_void_p,
                                   ctypes.c_int)
    lib.kv_int8_decode.restype = None
    lib.kv_bf16_all_finite.argtypes = (ctypes.c_void_p, i64)
    lib.kv_bf16_all_finite.restype = ctypes.c_int
    return lib
