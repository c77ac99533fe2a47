"""Python imports this module at startup when its directory is on PYTHONPATH: in a process started by a test
that called `StandInNeuronSDK.reach_new_processes` (a tensor-parallel worker), it installs the stand-in
Neuron SDK of tests/neuron_standin.py."""

import os
import sys
from pathlib import Path

if os.environ.get("OPTIMUM_QWEN36_TEST_NEURON_STANDIN"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where neuron_standin is
    from neuron_standin import STANDIN_ROOT_ENV, install_in_this_process

    install_in_this_process(Path(os.environ[STANDIN_ROOT_ENV]))
