"""The core is engine-agnostic: importing it never imports vLLM."""

import subprocess
import sys


def test_importing_core_does_not_import_vllm():
    code = "import sys, vllm_ddtree.core; assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
