"""Summarise a ``py-spy record -f raw`` profile: the hottest frames, inclusive and self.

    python3 spy_summary.py PROFILE.txt [--within FUNCTION] [--top N]

Only stacks that pass through ``--within`` (default ``LLM.generate``) count, so start-up and
warm-up stay out of the percentages.
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--within", default="LLM.generate")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.profile, encoding="utf-8") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not any(args.within in frame for frame in frames):
                continue
            n = int(count)
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    print(f"{total} samples within {args.within}")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"-- {title}")
        for frame, n in counter.most_common(args.top):
            print(f"{100 * n / max(total, 1):5.1f}%  {frame[:150]}")


if __name__ == "__main__":
    main()
