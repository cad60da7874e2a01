"""Where a learner's train message spends its time, from a sampling profile.

cProfile (``flower_scale.py --message-profile``) traces every call and so inflates the many
small ones; a sampling profiler does not. Record py-spy's raw stacks around the untraced
message loop, then read them here:

    py-spy record -r 500 --format raw -o spy.txt -- \\
        python benchmarks/flower_scale.py --message-cpu 60 --dims 100000
    python benchmarks/message_shares.py spy.txt

Only samples inside ``LearnerMessages.send`` count (a learner's train message), less those
of the one-time BLT build, calibration and imports of the learners' first messages. Each
sample goes to the first part in :data:`PARTS` that one of its frames names (the draws
before BLT's step that calls them, the release before the private step that forms it), else
to "rest".
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

#: (part, frame prefixes): the first part one of a sample's frames starts with
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("noise: the 4·d Gaussian draws", ("NoiseStream._draw ", "NoiseStream._draw_rows ")),
    ("noise: BLT's recurrence", ("BLTKernel.next ", "BLTKernel.steps ")),
    ("the task's gradient (plain's work too)", ("linear_gradient.<locals>.gradient ",)),
    ("load: read, check, rebuild the state", ("LearnerTransaction.open ",)),
    ("commit: write the new state", ("LearnerTransaction.commit ",
                                     "LearnerTransaction.__exit__ ")),
    ("the release g + e", ("NoiseStream._add ",)),
    ("gradient rows, finiteness, clipping", ("private_steps ",)),
    ("Flower's records (arrays in and out)", ("ArrayRecord.", "Array.from_numpy_ndarray ",
                                               "Array.numpy ", "Message.__init__ ")),
    ("privacy metrics", ("privacy_metrics ", "LearnerSession.privacy_metrics ")),
    ("the round's arithmetic (z −= η·g, Σ g)", ("local_rounds ",)),
)
REST = "the rest (session, config check, reply, …)"
MESSAGE = "LearnerMessages.send "
ONE_TIME = ("optimize_blt ", "_find_and_load ", "_calibration ")


def shares(lines: list[str]) -> tuple[int, dict[str, float]]:
    """(samples counted, {part: fraction}) from py-spy ``--format raw`` lines
    (``frame;frame;… count``)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        if not any(f.startswith(MESSAGE) for f in frames) or any(
                f.startswith(ONE_TIME) for f in frames):
            continue
        total += int(n)
        part = next((label for label, prefixes in PARTS
                     if any(f.startswith(prefixes) for f in frames)), REST)
        counts[part] += int(n)
    return total, {k: v / total for k, v in counts.most_common()} if total else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path, help="py-spy record --format raw output")
    args = p.parse_args()
    total, parts = shares(args.raw.read_text().splitlines())
    print(f"{total} samples inside a train message\n")
    print("| part | share of the message |\n|---|---|")
    for label, frac in parts.items():
        print(f"| {label} | {100 * frac:.0f} % |")


if __name__ == "__main__":
    main()
