"""Every fix a diagnosis offers has its premise hold: the recorded runs given (a corpus's kept
run files: ``blind_score.py --workdir``), each diagnosed, each offered fix checked against
the premise declared on it (``ampdoctor/diagnosis/fixes/premises.py``), and the first two
fixes listed.

    python benchmarks/blind_score.py --corpus fixtures/blind2 --workdir /tmp/blind2
    python benchmarks/premises.py /tmp/blind2/*.h5          # one line a run; exit 1 if unmet

Run from the repository root so that its ``ampdoctor`` is the one imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import ampdoctor
from ampdoctor.diagnosis.engine import unmet_premises


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run files (.h5)")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.runs:
        d = ampdoctor.diagnose(path)
        unmet = unmet_premises(path, d)
        failed += bool(unmet)
        first = ", ".join(fx.id for fx in d.fixes[:2]) or "-"
        print(f"{os.path.basename(path):44} {d.verdict:16} {d.confidence:.2f}  {first:36} "
              f"{'; '.join(unmet) if unmet else 'premises hold'}")
    print(f"{failed} of {len(args.runs)} runs offer a fix whose premise fails")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
