"""The environment megatron worker processes start with: CUDA_DEVICE_MAX_CONNECTIONS=1 where megatron-core
overlaps tensor-parallel communication with compute on a GPU."""

import pytest

from hybridflow.config.schema import Megatron
from hybridflow.workers.common import megatron_process_env


@pytest.mark.parametrize("tp,sp,on_gpu,expected", [
    (2, False, True, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),  # async all-reduce of input grads
    (4, True, True, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),  # sequence parallel
    (1, False, True, {}),  # no TP communication to overlap
    (2, True, False, {}),  # CPU: no CUDA
])
def test_set_where_tensor_parallel_comm_overlaps_on_gpu(tp, sp, on_gpu, expected, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert megatron_process_env(Megatron(tensor_model_parallel_size=tp, sequence_parallel=sp), on_gpu) == expected


def test_the_drivers_own_value_is_passed_on(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert megatron_process_env(Megatron(tensor_model_parallel_size=2), True) == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
