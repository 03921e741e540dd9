# Sourced by scripts/run_tests.sh: runs the parts of a test command so that every part runs even
# when an earlier one failed, and ends with one line per part (its result, its counts and its
# wall time). The caller decides which later parts still make sense after a failed one (its
# setup, say) and names those "not run".
# shellcheck shell=bash
TIMES=()
FAILED=0
timed() {  # label, command...: runs it, keeps its result and wall time for the summary at the
  # end, and returns its status (the caller decides whether later parts can still run)
  local label=$1 t0=$SECONDS rc log counts
  shift
  echo "== $label =="
  log=$(mktemp)
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  # the counts of a test part: pytest's last summary line, or ctest's
  counts=$(grep -aE '^(=+ )?[0-9]+ (passed|failed|errors?|skipped)\b.* in [0-9.]+s|tests passed, [0-9]+ tests failed' \
           "$log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
  rm -f "$log"
  local verdict=passed
  ((rc == 0)) || { verdict="FAILED (exit $rc)"; FAILED=1; }
  TIMES+=("$(printf '%-60s %5d s  %s%s' "$label" $((SECONDS - t0)) "$verdict" \
             "${counts:+: $counts}")")
  return "$rc"
}
skipped() {  # label, why: a part that could not run
  TIMES+=("$(printf '%-60s %5s    %s' "$1" - "NOT RUN ($2)")")
  FAILED=1
}

summary() {  # the table, then exit 1 if any part failed or did not run
  echo "== result and wall time per part =="
  printf '%s\n' "${TIMES[@]}"
  if ((FAILED)); then
    echo "== FAILED: at least one part failed or did not run (above) =="
    exit 1
  fi
  echo "== all parts passed =="
}
