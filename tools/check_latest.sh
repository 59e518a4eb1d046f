#!/usr/bin/env bash
# Run lint and the whole test suite against the NEWEST releases of every dependency (no constraints),
# in a fresh venv, the way a user who installs today gets them. CI pins constraints.txt; run this
# before refreshing it, and when a dependency ships a release.
#
#   tools/check_latest.sh            # fresh venv in .venv-latest, newest releases, lint + all tests
#   tools/check_latest.sh --write    # ... and, if green, record those releases in constraints.txt
#   tools/check_latest.sh -- -m "not slow"   # pass arguments after -- to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --write) write=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "usage: tools/check_latest.sh [--write] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
  esac
  shift
done
venv=.venv-latest
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
# torch stays on the release the project targets (the CPU wheel; an eager upgrade would pull the newest
# CUDA build): a one-line constraint holds it while everything else goes to its newest release
pin="$venv/torch-pin.txt"
echo "torch==2.13.0" > "$pin"
python -m pip install -q -c "$pin" torch==2.13.0
python -m pip install -q -c "$pin" --upgrade --upgrade-strategy eager ".[test]"
frozen=$(python -m pip freeze --exclude-editable | grep -v -E '^(mpconvert|-e )' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/')
echo "newest releases that differ from constraints.txt:"
diff <(grep -v '^#' constraints.txt | sort -f) <(echo "$frozen" | sort -f) | grep '^>' || echo "  (none)"
ruff check .
python -m pytest -q -p no:cacheprovider -n auto --dist loadfile "${pytest_args[@]}"
if [ "$write" = 1 ]; then
  { grep '^#' constraints.txt; echo "$frozen"; } > constraints.txt.new && mv constraints.txt.new constraints.txt
  echo "constraints.txt updated"
fi
