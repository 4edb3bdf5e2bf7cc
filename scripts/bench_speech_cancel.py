"""How long a cancel takes to stop Piper inside one long sentence without punctuation.

The job runs in a thread; its cancel flag is set 1 s after synthesis began; printed, the
seconds from the flag to ``GenerationCancelled`` (median of ``--runs``)::

    PYTHONSAFEPATH=1 PYTHONPATH=. INCLAVATE_HOME=... python scripts/bench_speech_cancel.py [--words 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

from node.generators.base import GenerationCancelled, GenerationTask
from node.generators.loader import installed_generators

WORDS = "the quick brown fox jumps over the lazy dog while the river runs past the old mill".split()


def one_cancel(generator: object, text: str, after_s: float) -> float:
    flag = threading.Event()
    began = threading.Event()
    stopped: list[float] = []

    def progress(stage: str, fraction: float) -> None:
        if stage == "generating":
            began.set()

    def run() -> None:
        try:
            generator.run(GenerationTask("job", "piper:joe", "audio", {"text": text}), flag.is_set, progress)  # type: ignore[attr-defined]
        except GenerationCancelled:
            stopped.append(time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    began.wait()
    time.sleep(after_s)
    flag.set()
    cancelled_at = time.monotonic()
    thread.join()
    assert stopped, "the job finished before the cancel"
    return stopped[0] - cancelled_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    generator = installed_generators(Path(os.environ["INCLAVATE_HOME"]))["piper:joe"]
    text = " ".join((WORDS * (args.words // len(WORDS) + 1))[: args.words])
    generator.run(GenerationTask("warm", "piper:joe", "audio", {"text": "Hello."}), lambda: False, lambda s, f: None)
    latencies = [one_cancel(generator, text, 1.0) for _ in range(args.runs)]
    print(f"cancel 1 s into a {args.words}-word sentence without punctuation: stopped after "
          f"{statistics.median(latencies):.2f} s (median of {args.runs}; all: {', '.join(f'{x:.2f}' for x in latencies)})")  # fmt: skip


if __name__ == "__main__":
    main()
