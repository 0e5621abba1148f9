"""Test-only: Python runs this at start-up in processes whose PYTHONPATH holds this folder.

The test harness puts the folder there, with ``VT_TEST_FAULTS_DIR``, only for the processes it
starts (see :mod:`tests.faults`); the fault hooks of :mod:`vt_faults` are then registered in
them and in everything they start. Without the variable nothing is imported.
"""
import os

if os.environ.get("VT_TEST_FAULTS_DIR"):
    import vt_faults

    vt_faults.install()
