#!/usr/bin/env bash
# Make sure a headless-capable Chromium exists for the UI test, and print the path to drive.
#   scripts/browser.sh            # -> /usr/bin/chromium
# Debian's chromium is installed with apt-get when it is missing; a browser already there is reused.
# No tool may download a browser of its own (Playwright is told where this one is), so the UI test
# runs the same browser on a developer's machine and in CI. Set E31_CHROMIUM to use another one.
set -euo pipefail

CHROMIUM=${E31_CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$CHROMIUM" ]; then
  if [ "$CHROMIUM" != /usr/bin/chromium ]; then
    echo "E31_CHROMIUM=$CHROMIUM is not an executable; unset it to install Debian's chromium" >&2
    exit 1
  fi
  echo "installing chromium ..." >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
fi
# The version line proves the browser starts on this machine (missing libraries show here, not in the test).
"$CHROMIUM" --headless --no-sandbox --disable-gpu --version >&2
echo "$CHROMIUM"
