# Creates the demo's toy repository (run through the executor, in the demo directory).
set -eu
git -c init.defaultBranch=main init -q .
cat > mathlib.sh <<'LIB'
# A tiny arithmetic library.
add() {
  echo $(( $1 - $2 ))
}
LIB
cat > test.sh <<'TEST'
#!/usr/bin/env bash
# Tests for mathlib.sh; run with: bash test.sh
source "$(dirname "$0")/mathlib.sh"
result=$(add 2 3)
if [ "$result" != 5 ]; then
  echo "FAIL: add 2 3 gave $result, expected 5"
  exit 1
fi
echo "PASS: all tests passed"
TEST
git add -A
git -c user.name=demo -c user.email=demo@example.invalid commit -q -m "Toy repository with a failing test"
echo "toy repository ready in $(pwd)"
