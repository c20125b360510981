#!/usr/bin/env bash
# Install the headless Chromium the `nvrx inspect --html` browser test renders its report in (Debian's
# `chromium` package; idempotent). Never fails: when Chromium cannot be installed it prints one line saying
# why and exits 0, and the browser test then skips with its own reason.
set -uo pipefail

unusable() {  # one line why; exit 0
    echo "install_chromium: $1; the --html browser test will skip"
    exit 0
}

for bin in chromium chromium-browser; do
    command -v "$bin" >/dev/null && exit 0
done
[ "$(id -u)" = 0 ] || unusable "chromium is not installed and we are not root (run this script as root)"
command -v apt-get >/dev/null || unusable "chromium is not installed and there is no apt-get; install chromium yourself"

export DEBIAN_FRONTEND=noninteractive
LOG=/tmp/install_chromium.$$.log
if ! apt-cache show chromium >/dev/null 2>&1; then  # refresh the package lists only when apt does not know it
    apt-get update -qq >/dev/null 2>&1 || true
fi
if ! apt-get install -y -qq --no-install-recommends chromium >"$LOG" 2>&1; then
    unusable "apt-get install chromium failed ($(tail -n 1 "$LOG"))"
fi
rm -f "$LOG"
command -v chromium >/dev/null || unusable "the chromium package installed no chromium command"
exit 0
