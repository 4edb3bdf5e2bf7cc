"""Every float32 that fits float16 (|x| <= 65,504, both signs: ~2.4 billion values) through
the eval callback's float16 conversion (``node/native/eval_capture.c``), against numpy's
``astype(np.float16)``: they must agree bit for bit, since a hop's output leaves in the
callback's bits where it left in numpy's before. About 4 minutes on one core.

    PYTHONSAFEPATH=1 PYTHONPATH=. .venv/bin/python scripts/check_half_conversion.py
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np

from node import eval_capture

HALF_MAX_BITS = 0x477FE000  # 65504.0f
CHUNK = 1 << 25


def main() -> int:
    library = eval_capture.native_library()
    if library is None:
        print("the C callback did not build here: nothing to check")
        return 1
    started, mismatches = time.monotonic(), 0
    out = np.empty(CHUNK, dtype=np.uint16)
    for first in range(0, HALF_MAX_BITS + 1, CHUNK):
        bits = np.arange(first, min(first + CHUNK, HALF_MAX_BITS + 1), dtype=np.uint32)
        for sign in (0, 0x80000000):
            x = (bits | np.uint32(sign)).view(np.float32)
            if library.inclavate_to_half(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data),
                                         ctypes.c_int64(len(x))) != 1:  # fmt: skip
                print(f"refused a value that fits, in the chunk from {first:#x}")
                return 1
            mismatches += int((out[: len(x)] != x.astype(np.float16).view(np.uint16)).sum())
    print(f"{mismatches} mismatches over {2 * (HALF_MAX_BITS + 1):,} values in {time.monotonic() - started:.0f} s")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
