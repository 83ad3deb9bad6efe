#!/usr/bin/env bash
# Build a wheel, install it into a fresh venv (no editable install, no source tree on the path)
# and record + diagnose a fixture with it: a missing _bootstrap/ or subpackage fails here.
# The fresh venv reads torch, numpy, h5py, click and matplotlib from the venv this script runs
# in (a .pth file) instead of downloading torch again: what is tested is the wheel's own files.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip wheel -q --no-deps -w "$work/dist" "$root"
deps="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python3 -m venv "$work/venv"
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$deps" > "$site/ampdoctor-ci-deps.pth"
"$work/venv/bin/pip" install -q --no-deps "$work"/dist/ampdoctor-*.whl
cd "$work"  # not the repository: the wheel's files, nothing else
unset PYTHONPATH
"$work/venv/bin/ampdoctor" record -q -o x.h5 -- "$work/venv/bin/python" \
    "$root/fixtures/verdicts/unstable_op.py" --steps 12
set +e
"$work/venv/bin/ampdoctor" diagnose x.h5 --format json --fail-on unhealthy > d.json
code=$?
set -e
"$work/venv/bin/python" - "$code" <<'PY'
import json, sys
d = json.load(open("d.json"))
assert d["verdict"] == "unstable_op", d["verdict"]
assert sys.argv[1] == "1", f"diagnose --fail-on unhealthy exited {sys.argv[1]}, not 1"
import ampdoctor, ampdoctor.record.command, os
assert ampdoctor.__file__.startswith(sys.prefix), (ampdoctor.__file__, sys.prefix)
boot = os.path.join(os.path.dirname(ampdoctor.record.command.__file__), "_bootstrap", "sitecustomize.py")
assert os.path.isfile(boot), boot
print(f"wheel smoke test: {d['verdict']} from the installed wheel")
PY
