# A long quiet command that says, every few seconds, what it is doing and how long it has been going.
# Sourced (scripts/install_horovod.sh: the Horovod build, which pip keeps quiet for minutes).
#
#   with_ticker WHAT COMMAND [ARG...]
#
# runs COMMAND and, while it runs, writes "WHAT: m:ss so far" to stderr every TRAINER_TICKER_EVERY_S
# seconds (default 20; a short command prints nothing). Returns COMMAND's exit status, and the
# ticker ends with COMMAND, failed or not: no process of it is left. Should this shell itself be
# killed, the ticker notices at its next tick and ends without a line.

with_ticker() {
    local what=$1 every=${TRAINER_TICKER_EVERY_S:-20} start=$SECONDS ticker status=0
    shift
    (
        # its nap (its only job) ends with it; the naps hold none of the caller's pipes
        trap 'kill $(jobs -p) 2>/dev/null; exit 0' TERM
        while :; do
            sleep "$every" >/dev/null 2>&1 &
            wait $! || exit 0
            kill -0 $$ 2>/dev/null || exit 0  # the shell that started it is gone
            elapsed=$((SECONDS - start))
            printf '%s: %d:%02d so far\n' "$what" $((elapsed / 60)) $((elapsed % 60)) >&2
        done
    ) &
    ticker=$!
    "$@" || status=$?
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    return "$status"
}
