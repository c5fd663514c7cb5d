"""Summarize a py-spy raw profile: the top frames, inclusive and self, in % of samples.
   python spy_top.py PROFILE.txt [N]"""

import collections
import sys


def main(path: str, top: int) -> None:
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            continue
        stack, count = line.rstrip().rsplit(" ", 1)
        n = int(count)
        total += n
        frames = stack.split(";")
        for key in {f.split(":")[0] for f in frames}:  # function (file), once per sample
            incl[key] += n
        own[frames[-1]] += n
    print(f"{path}: {total} samples")
    print("-- inclusive")
    for k, c in incl.most_common(top):
        print(f"{100 * c / total:5.1f}% {k[:150]}")
    print("-- self")
    for k, c in own.most_common(12):
        print(f"{100 * c / total:5.1f}% {k[:150]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
