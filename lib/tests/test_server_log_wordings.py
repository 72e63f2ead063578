"""``read_startup_log`` on the usage summary of every release from 0.10.2 to 0.33.0 (``USAGE_WORDINGS``).

Each message is built here by the release's own f-string, its literal text
copied from that release's wheel (``vllm/v1/worker/gpu_worker.py``, the
lines cited above each), over a stand-in worker whose byte counts are known;
the reader must give back those byte counts, rounded as vLLM rounds them.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from pagedkv import server_log
from pagedkv.server_log import USAGE_WORDINGS, read_startup_log

GiB_bytes = 1 << 30
POOL = "Available KV cache memory: 52.1 GiB"  # read_startup_log needs the pool's line


def GiB(b):  # noqa: N802  the lambda 0.10.2-0.13.0 define in the method (gpu_worker.py:355 in 0.10.2)
    return round(b / GiB_bytes, 2)


def format_gib(b):  # vllm/utils/mem_utils.py, 0.14.0 on: the same figure, as a str
    return f"{round(b / GiB_bytes, 2)}"


def _worker(weights=14.99, activation=1.26, non_torch=1.79, consumed=16.78):
    """The attributes the f-strings read, in bytes (an H100's 79.19 GiB, utilization 0.9)."""
    b = lambda gib: int(gib * GiB_bytes)  # noqa: E731
    return SimpleNamespace(
        init_snapshot=SimpleNamespace(free_memory=b(78.9), total_memory=b(79.19)),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9), requested_memory=b(71.27),
        model_runner=SimpleNamespace(model_memory_usage=b(weights)), peak_activation_memory=b(activation),
        non_torch_memory=b(non_torch), total_consumed=b(consumed), available_kv_cache_memory_bytes=b(52.1))


CUDA_GRAPHS = int(0.52 * GiB_bytes)
TO_REQUESTED, TO_GPU = 55_000_000_000, 62_000_000_000


def message_0_10_2(self, cuda_graph_memory_bytes=CUDA_GRAPHS, kv_cache_memory_bytes_to_requested_limit=TO_REQUESTED,
                   kv_cache_memory_bytes_to_gpu_limit=TO_GPU):
    # vLLM 0.10.2, v1/worker/gpu_worker.py:372-389 (logged at INFO, line 391).
    msg = (
        f"Free memory on device "
        f"({GiB(self.init_snapshot.free_memory)}/"
        f"{GiB(self.init_snapshot.total_memory)} GiB) on startup. "
        f"Desired GPU memory utilization is "
        f"({self.cache_config.gpu_memory_utilization}, "
        f"{GiB(self.requested_memory)} GiB). "
        f"Actual usage is {GiB(self.model_runner.model_memory_usage)} "
        f"GiB for weight, {GiB(self.peak_activation_memory)} GiB "
        f"for peak activation, {GiB(self.non_torch_memory)} GiB "
        f"for non-torch memory, and {GiB(cuda_graph_memory_bytes)} "
        f"GiB for CUDAGraph memory. Replace gpu_memory_utilization "
        f"config with `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_requested_limit}` to fit into "
        f"requested memory, or `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_gpu_limit}` to fully "
        f"utilize gpu memory. Current kv cache memory in use is "
        f"{int(self.available_kv_cache_memory_bytes)} bytes.")
    return msg


def message_0_11_0(self, cuda_graph_memory_bytes=CUDA_GRAPHS, kv_cache_memory_bytes_to_requested_limit=TO_REQUESTED,
                   kv_cache_memory_bytes_to_gpu_limit=TO_GPU):
    # vLLM 0.11.0, v1/worker/gpu_worker.py:372-391 (logged at DEBUG, line 393); the same in 0.11.1-0.13.0.
    msg = (
        f"Free memory on device "
        f"({GiB(self.init_snapshot.free_memory)}/"
        f"{GiB(self.init_snapshot.total_memory)} GiB) on startup. "
        f"Desired GPU memory utilization is "
        f"({self.cache_config.gpu_memory_utilization}, "
        f"{GiB(self.requested_memory)} GiB). "
        f"Actual usage is {GiB(self.model_runner.model_memory_usage)} "
        f"GiB for weight, {GiB(self.peak_activation_memory)} GiB "
        f"for peak activation, {GiB(self.non_torch_memory)} GiB "
        f"for non-torch memory, and {GiB(cuda_graph_memory_bytes)} "
        f"GiB for CUDAGraph memory. Replace gpu_memory_utilization "
        f"config with `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_requested_limit}` "
        f"({GiB(kv_cache_memory_bytes_to_requested_limit)} GiB) to fit "
        f"into requested memory, or `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_gpu_limit}` "
        f"({GiB(kv_cache_memory_bytes_to_gpu_limit)} GiB) to fully "
        f"utilize gpu memory. Current kv cache memory in use is "
        f"{GiB(self.available_kv_cache_memory_bytes)} GiB.")
    return msg


def message_0_26_0(self, cuda_graph_memory_bytes=CUDA_GRAPHS, kv_cache_memory_bytes_to_requested_limit=TO_REQUESTED,
                   kv_cache_memory_bytes_to_gpu_limit=TO_GPU):
    # vLLM 0.26.0, v1/worker/gpu_worker.py:835-855 (logged at INFO, line 857); the same text from 0.14.0
    # (format_gib in place of GiB), logged at DEBUG up to 0.25.1 (0.25.1's line 835).
    msg = (
        f"Free memory on device "
        f"({format_gib(self.init_snapshot.free_memory)}/"
        f"{format_gib(self.init_snapshot.total_memory)} GiB) on startup. "
        f"Desired GPU memory utilization is "
        f"({self.cache_config.gpu_memory_utilization}, "
        f"{format_gib(self.requested_memory)} GiB). "
        f"Actual usage is {format_gib(self.model_runner.model_memory_usage)} "
        f"GiB for weight, {format_gib(self.peak_activation_memory)} GiB "
        f"for peak activation, {format_gib(self.non_torch_memory)} GiB "
        f"for non-torch memory, and {format_gib(cuda_graph_memory_bytes)} "
        f"GiB for CUDAGraph memory. Replace gpu_memory_utilization "
        f"config with `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_requested_limit}` "
        f"({format_gib(kv_cache_memory_bytes_to_requested_limit)} GiB) to fit "
        f"into requested memory, or `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_gpu_limit}` "
        f"({format_gib(kv_cache_memory_bytes_to_gpu_limit)} GiB) to fully "
        f"utilize gpu memory. Current kv cache memory in use is "
        f"{format_gib(self.available_kv_cache_memory_bytes)} GiB."
    )
    return msg


def message_0_33_0(self, cuda_graph_memory_bytes=CUDA_GRAPHS, kv_cache_memory_bytes_to_requested_limit=TO_REQUESTED,
                   kv_cache_memory_bytes_to_gpu_limit=TO_GPU):
    # vLLM 0.33.0, v1/worker/gpu_worker.py:1044-1064 (logged at INFO, line 1066); the same text in
    # 0.27.0, v1/worker/gpu_worker.py:767-787, and every release between.
    msg = (
        f"Free memory on device "
        f"({format_gib(self.init_snapshot.free_memory)}/"
        f"{format_gib(self.init_snapshot.total_memory)} GiB) on startup. "
        f"Desired GPU memory utilization is "
        f"({self.cache_config.gpu_memory_utilization}, "
        f"{format_gib(self.requested_memory)} GiB). "
        f"Actual usage is {format_gib(self.total_consumed)} "
        f"GiB for consumed memory (weights + non-torch), "
        f"{format_gib(self.peak_activation_memory)} GiB "
        f"for peak activation, and {format_gib(cuda_graph_memory_bytes)} "
        f"GiB for CUDAGraph memory. Replace gpu_memory_utilization "
        f"config with `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_requested_limit}` "
        f"({format_gib(kv_cache_memory_bytes_to_requested_limit)} GiB) to fit "
        f"into requested memory, or `--kv-cache-memory="
        f"{kv_cache_memory_bytes_to_gpu_limit}` "
        f"({format_gib(kv_cache_memory_bytes_to_gpu_limit)} GiB) to fully "
        f"utilize gpu memory. Current kv cache memory in use is "
        f"{format_gib(self.available_kv_cache_memory_bytes)} GiB."
    )
    return msg


def _read(message: str):
    return read_startup_log(f"INFO 12-02 11:00:00 [gpu_worker.py:1066] {message}\n{POOL}")


def _summary(log):
    return (log.free_gib, log.total_gib, log.gpu_memory_utilization, log.requested_gib)


def test_the_table_names_each_wording_once_and_the_releases_meet():
    assert [w[0] for w in USAGE_WORDINGS] == ["0.10.2-0.26.0", "0.27.0-0.33.0"]
    assert len({w[2].pattern for w in USAGE_WORDINGS}) == len(USAGE_WORDINGS)


@pytest.mark.parametrize("render", [message_0_10_2, message_0_11_0, message_0_26_0],
                         ids=["0.10.2", "0.11.0", "0.26.0"])
def test_the_four_figure_wording_0_10_2_to_0_26_0(render):
    message = render(_worker())
    log = _read(message)
    assert (log.weights_gib, log.activation_gib, log.non_torch_gib, log.cudagraph_gib) == (14.99, 1.26, 1.79, 0.52)
    assert log.consumed_gib == round(14.99 + 1.79, 2) and log.usage_releases == "0.10.2-0.26.0"
    assert _summary(log) == (78.9, 79.19, 0.9, 71.27)
    assert log.derived_non_kv_gib == round(71.27 - 52.1, 2)  # the pool's line, not the usage line
    # Negative non-torch memory (it can shrink while profiling) prints with its sign and reads.
    log = _read(render(_worker(non_torch=-0.25)))
    assert log.non_torch_gib == -0.25 and log.consumed_gib == round(14.99 - 0.25, 2)


def test_the_three_figure_wording_0_27_0_to_0_33_0():
    log = _read(message_0_33_0(_worker()))
    assert (log.consumed_gib, log.activation_gib, log.cudagraph_gib) == (16.78, 1.26, 0.52)
    assert (log.weights_gib, log.non_torch_gib) == (None, None)  # printed as one figure
    assert log.usage_releases == "0.27.0-0.33.0" and _summary(log) == (78.9, 79.19, 0.9, 71.27)


def test_the_readers_own_lines_are_the_0_33_0_wording():
    from pagedkv import budget
    p = budget.plan(model="Llama-3.1-70B", tensor_parallel_size=4, gpu_memory_utilization=0.9, request_len=2_500)
    log = read_startup_log("\n".join(server_log.server_log_lines(p, cudagraph_gib=1.0)))
    assert log.usage_releases == "0.27.0-0.33.0" and log.cudagraph_gib == 1.0


@pytest.mark.parametrize("render", [message_0_10_2, message_0_33_0], ids=["0.10.2", "0.33.0"])
def test_a_wrapped_or_cut_message_still_reads(render):
    message = render(_worker())
    wrapped = textwrap.fill(message, 79, subsequent_indent="    ", break_on_hyphens=False)
    assert "\n" in wrapped[wrapped.index("Actual"):wrapped.index("CUDAGraph")]
    assert _read(wrapped) == _read(message)
    cut = message[:message.index("CUDAGraph memory.") + len("CUDAGraph memory.")]
    assert _read(cut) == _read(message)


def test_the_last_message_wins_whatever_its_wording():
    log = _read(message_0_26_0(_worker()) + "\n" + message_0_33_0(_worker(consumed=20.0)))
    assert log.consumed_gib == 20.0 and log.weights_gib is None and log.usage_releases == "0.27.0-0.33.0"
    log = _read(message_0_33_0(_worker()) + "\n" + message_0_11_0(_worker(weights=7.5)))
    assert log.weights_gib == 7.5 and log.usage_releases == "0.10.2-0.26.0"


GOOD = message_0_26_0(_worker())


@pytest.mark.parametrize("sentence", [
    GOOD.replace("14.99 GiB for weight", "1.2.3 GiB for weight"),          # a figure that is no number
    GOOD.replace("14.99 GiB for weight", "nan GiB for weight"),
    GOOD.replace("1.79 GiB for non-torch memory, ", ""),                   # a figure missing
    GOOD.replace("GiB for weight", "GiB for weights"),                     # a label no release prints
    message_0_33_0(_worker()).replace("(weights + non-torch)", "(weights)"),
    "Actual usage is unknown",
])
def test_a_sentence_in_no_known_wording_is_refused_by_name(sentence):
    with pytest.raises(ValueError) as raised:
        _read(sentence)
    text = str(raised.value)
    assert "'Actual usage is ...' sentence" in text and "none of the wordings vLLM 0.10.2 to 0.33.0" in text
    start = sentence.index("Actual usage is")
    assert repr(sentence[start:start + 200])[:60] in text  # the sentence itself, quoted
    assert "0.10.2-0.26.0; 0.27.0-0.33.0" in text


def test_a_log_without_the_sentence_reads_as_before():
    log = _read("Free memory on device (78.9/79.19 GiB) on startup. Desired GPU memory utilization is (0.9, "
                "71.27 GiB).")
    assert _summary(log) == (78.9, 79.19, 0.9, 71.27)
    assert (log.consumed_gib, log.weights_gib, log.usage_releases) == (None, None, None)
