#!/usr/bin/env bash
# Runs every test of the project: the Rust workspace (engine, planner, CLI, C ABI, end-to-end
# tests), the Python package against CPU PyTorch, and the raw NVMe backends inside a KVM guest.
# Installs what the Python tests need into target/py-venv on first use. README.md gives this
# command; .ci/run runs it after installing system packages and checking format and lints.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== Rust workspace"
cargo test --workspace

echo "== Python package (CPU PyTorch)"
venv=target/py-venv
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
"$venv/bin/pip" install -q torch numpy pytest transformers accelerate lightning peft trl
"$venv/bin/pip" install -q --force-reinstall --no-deps ./bindings/python
# pytest's own temporary directories under target/ too (its default is /tmp/pytest-of-$USER).
TERAIO_TEST_DIR="$PWD/target/py-test-stores" "$venv/bin/python" -m pytest -q --basetemp target/pytest-tmp \
  bindings/python/tests

echo "== raw NVMe backends in a guest with emulated NVMe drives"
bash scripts/kvm/run-guest-tests.sh tests
