"""Errors kept after they are handled (on a stream, a reservation, in a queue) carry no traceback: raised
again, each time as a fresh copy, they leave the kept one without frames (which would hold what keeps it)."""

from __future__ import annotations

import grpc
import pytest

from kvtransfer.errors import ShmUnusable, TransferFailed, TransferRefused, detached, fresh

pytestmark = [pytest.mark.unit]


def _raised(exc: BaseException) -> BaseException:
    try:
        try:
            raise ValueError("the cause")
        except ValueError:
            raise exc  # noqa: B904 - chained on purpose: detached must drop the context too
    except BaseException as caught:
        return caught


@pytest.mark.parametrize("exc", [TransferFailed("refused", grpc.StatusCode.NOT_FOUND),
                                 TransferRefused(grpc.StatusCode.CANCELLED, "aborted"),
                                 ShmUnusable("/dev/shm is full", lasting=True)])
def test_fresh_copies_type_message_and_fields_and_detached_drops_frames(exc):
    kept = _raised(exc)
    assert kept.__traceback__ is not None and kept.__context__ is not None
    assert detached(kept) is kept and (kept.__traceback__, kept.__context__, kept.__cause__) == (None, None, None)
    again = _raised(fresh(kept))
    assert again is not kept and type(again) is type(kept) and str(again) == str(kept)
    assert vars(again) == vars(kept)  # code, message, lasting
    assert kept.__traceback__ is None  # raising the copy left the kept one as it was
