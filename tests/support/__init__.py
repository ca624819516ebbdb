"""What the test suites share and is not a test: helpers they import and scripts they launch.

Helpers (imported as `from support import hf_tiny`; tests/conftest.py puts tests/ on sys.path, so the same import
works in every suite, in the child pytests of tests/device/emu and the transformers matrix, and in tests/integrations/axolotl_ci):
  hf_tiny        tiny real transformers models, same-seed twins, training steps, bitwise comparison
  subclasses     tensor subclasses (a wrapper subclass) for the tensor-kind and corpus suites
  device_model   the checkpointed models every device test runs (emulated device and GPU alike)
  waits          polling with a deadline for work on other threads (spill writes)
  scheduling     how `make test` spreads the suite over pytest-xdist workers (one per shared 2-rank launch)
  limited        a child Python process under an address-space cap and a timeout (regressions that grow without
                 end fail there, not on the shared machine)
  upstream/      other projects' test code, copied verbatim from a named release (transformers 5.23's training
                 tests)
Scripts (run by path in a fresh process, under torchrun or plain python; they import nothing from this package):
  fsdp_worker    one rank of tests/loading/test_fsdp.py
  dtensor_worker one rank of the 2-process test in tests/offload/test_dtensor.py
  ts_worker      TorchScript training without the Python package (tests/engine/test_torchscript_compile.py)
  hf_peer_suite  transformers' own training tests with a scope around each, and a mocked checkpoint function
                 (tests/offload/test_transformers_peer_suite.py, under `limited`)
"""
