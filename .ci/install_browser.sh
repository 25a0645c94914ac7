#!/usr/bin/env bash
# Install what tests/test_queue_instrument_browser.py needs: Debian's chromium and
# chromium-driver (headless Chromium driven through chromedriver). Idempotent: installs
# nothing when both are already present. The Python side (selenium) comes with the
# project's dev extras: pip install -e '.[dev]'.
set -euo pipefail

need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)

if [ ${#need[@]} -eq 0 ]; then
    echo "install_browser: chromium and chromedriver already installed"
else
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || { echo "install_browser: need root or sudo to install ${need[*]}" >&2; exit 1; }
        SUDO="sudo"
    fi
    echo "install_browser: installing ${need[*]}"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}"
fi

/usr/bin/chromium --version 2>/dev/null || true
/usr/bin/chromedriver --version

# Optional: PYTHON=path/to/python makes sure selenium is importable there too.
if [ -n "${PYTHON:-}" ]; then
    "$PYTHON" -c "import selenium" 2>/dev/null || "$PYTHON" -m pip install -q "selenium>=4.11"
    "$PYTHON" -c "import selenium; print('selenium', selenium.__version__)"
fi
