"""GPU presets and GPUs given by their memory (issue 46 item 3): the MiB forms
nvidia-smi prints, refusals by name, each preset's figures and sources, and
device-name matching that keeps form factors apart."""

import dataclasses

import pytest

from pagedkv import budget as b
from pagedkv.budget import GPUSpec, MiB

# (preset, nvidia-smi total MiB, datasheet GB/s, CUDA device name)
PRESETS = [
    ("H100 SXM 80GB", 81_559, 3_350.0, "NVIDIA H100 80GB HBM3"),
    ("H100 PCIe", 81_559, 2_000.0, "NVIDIA H100 PCIe"),  # TensorRT-LLM backend guide; PB-11133
    ("H100 NVL", 95_830, 3_900.0, "NVIDIA H100 NVL"),
    ("H20", 97_871, None, "NVIDIA H20"),  # nvidia-smi in NVIDIA/nvtrust issue 128; no datasheet
    ("H200", 143_771, 4_800.0, "NVIDIA H200"),
    ("A100 SXM 80GB", 81_920, 2_039.0, "NVIDIA A100-SXM4-80GB"),
    ("A100 SXM 40GB", 40_960, 1_555.0, "NVIDIA A100-SXM4-40GB"),
    ("L40S", 46_068, 864.0, "NVIDIA L40S"),
    ("L4", 23_034, 300.0, "NVIDIA L4"),
    ("A10G", 23_028, None, "NVIDIA A10G"),  # AWS's A10 variant: no NVIDIA datasheet
    ("RTX 4090", 24_564, 1_008.0, "NVIDIA GeForce RTX 4090"),
    ("B200", 183_359, 8_000.0, "NVIDIA B200"),
    ("MI300X", 196_592, 5_300.0, "AMD Instinct MI300X"),  # rocminfo / rocm-smi total
]


def test_the_preset_table_is_the_one_tested():
    assert [p[0] for p in PRESETS] == list(b.GPUS)


@pytest.mark.parametrize("name,mib,gbs,device", PRESETS)
def test_each_preset_has_its_figures_and_sources(name, mib, gbs, device):
    g = b.gpu_spec(name)
    assert (g.name, g.total_mib, g.peak_bandwidth_gbs) == (name, mib, gbs)
    assert g.total_bytes == mib * MiB
    assert g.source.startswith("https://github.com/") or g.source.startswith("https://thundergolfer")
    # a bandwidth has its datasheet; an unknown one has none and is refused by name
    assert g.bandwidth_source.startswith("https://") == (gbs is not None)
    if gbs is None:
        with pytest.raises(ValueError, match=f"and '{name}' has none"):
            g.require_bandwidth("share of peak")
    assert b.gpu_for_device_name(device) is g
    assert b.gpu_for_device_name(f"  {device}\n") is g  # as a shell pipe hands it over


@pytest.mark.parametrize("name,mib,gbs,device", PRESETS)
def test_each_preset_plans_as_its_total_in_mib(name, mib, gbs, device):
    # plan(gpu=name) sizes from the preset's total alone: the same pool as the
    # total given as nvidia-smi prints it.
    # 4 GiB of weights (an 8B model in 4 bits) fits every preset, the 24 GB cards too
    by_name, by_mib = b.plan(gpu=name, weight_gib=4.0), b.plan(gpu=f"{mib} MiB", weight_gib=4.0)
    assert by_name.gpu == name
    assert (by_name.num_blocks, by_name.pool_bytes) == (by_mib.num_blocks, by_mib.pool_bytes)
    assert by_name.num_blocks > 0


def test_more_memory_never_plans_fewer_blocks():
    ordered = sorted(PRESETS, key=lambda p: p[1])
    blocks = [b.plan(gpu=name, weight_gib=4.0).num_blocks for name, *_ in ordered]
    assert blocks == sorted(blocks)
    # equal totals plan equal pools (the H100 PCIe and SXM both print 81,559 MiB),
    # different totals different ones
    by_total = {mib: n for (_, mib, *_), n in zip(ordered, blocks)}
    assert len(set(by_total.values())) == len(by_total) < len(PRESETS)


@pytest.mark.parametrize("text", ["81559MiB", "81559 MiB", " 81559 MiB\n", "81,559 MiB", "81559 mib"])
def test_a_gpu_given_as_nvidia_smi_prints_its_memory(text):
    g = b.gpu_spec(text)
    assert (g.name, g.total_mib, g.peak_bandwidth_gbs) == ("a 81,559-MiB GPU", 81_559, None)
    assert g == GPUSpec.from_mib(81_559)
    # Sizing never reads the bandwidth: the same plan as the preset with the same memory.
    assert b.plan(gpu=text, weight_gib=14.96).num_blocks == b.plan(weight_gib=14.96).num_blocks == 26_785
    assert b.plan(gpu=text).gpu == "a 81,559-MiB GPU"


def test_from_mib_names_and_bandwidth():
    g = GPUSpec.from_mib(95_830, "H100 NVL", peak_bandwidth_gbs=3_900)
    assert (g.name, g.total_mib, g.peak_bandwidth_gbs) == ("H100 NVL", 95_830, 3_900.0)
    assert g.require_bandwidth("share of peak") == 3_900.0
    # the older spelling of "bandwidth unknown" still works and means the same
    assert GPUSpec("a 22,895-MiB GPU", 22_895, 0.0) == GPUSpec.from_mib(22_895)


def test_a_figure_that_needs_bandwidth_refuses_by_name():
    g = b.gpu_spec("46068 MiB")
    with pytest.raises(ValueError, match=r"share of peak needs the GPU's peak memory bandwidth, "
                                         r"and 'a 46,068-MiB GPU' has none"):
        g.require_bandwidth("share of peak")
    assert b.gpu_spec("L40S").require_bandwidth() == 864.0


@pytest.mark.parametrize("bad,exc,words", [
    (81_559, TypeError, "got int 81559; a memory size needs its unit: '81559 MiB'"),
    (81_559.0, TypeError, "got float 81559.0"),
    (True, TypeError, "got bool True"),
    (None, TypeError, "got NoneType None"),
    ("0 MiB", ValueError, "at least 1 MiB, got '0 MiB'"),
    ("-5 MiB", ValueError, "unknown GPU '-5 MiB'"),
    ("80GB", ValueError, "unknown GPU '80GB'"),
    ("81559 MB", ValueError, "unknown GPU '81559 MB'"),
    ("81559", ValueError, "unknown GPU '81559'"),
    ("81559 MiB\n81559 MiB", ValueError, "unknown GPU"),  # two GPUs' lines: say which one
    ("H100", ValueError, "unknown GPU 'H100'"),
])
def test_bad_gpus_are_refused_by_name(bad, exc, words):
    with pytest.raises(exc, match=None) as info:
        b.gpu_spec(bad)
    assert words in str(info.value)
    with pytest.raises(exc):
        b.plan(gpu=bad)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(total_mib=0), ValueError, "GPUSpec total_mib must be >= 1, got 0"),
    (dict(total_mib=-1), ValueError, "GPUSpec total_mib must be >= 1, got -1"),
    (dict(total_mib=81_559.0), TypeError, "GPUSpec total_mib must be an int, got float 81559.0"),
    (dict(total_mib=True), TypeError, "GPUSpec total_mib must be an int, got bool True"),
    (dict(peak_bandwidth_gbs=-1.0), ValueError, "GPUSpec peak_bandwidth_gbs"),
    (dict(peak_bandwidth_gbs=float("nan")), ValueError, "GPUSpec peak_bandwidth_gbs"),
    (dict(peak_bandwidth_gbs="fast"), TypeError, "GPUSpec peak_bandwidth_gbs must be a number"),
    (dict(name=""), TypeError, "GPUSpec name must be a non-empty str"),
    (dict(device_names="NVIDIA L4"), TypeError, "GPUSpec device_names must be a tuple of str"),
])
def test_gpuspec_refuses_bad_fields_by_name(kwargs, exc, words):
    fields = dict(name="mine", total_mib=1_000, peak_bandwidth_gbs=None)
    with pytest.raises(exc) as info:
        GPUSpec(**{**fields, **kwargs})
    assert words in str(info.value)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                                     (False, TypeError), ("81559", TypeError)])
def test_from_mib_refuses_bad_sizes(bad, exc):
    with pytest.raises(exc, match="total_mib"):
        GPUSpec.from_mib(bad)


def test_refusals_change_no_preset():
    before = {k: dataclasses.astuple(v) for k, v in b.GPUS.items()}
    for bad in (0, "0 MiB", "nonsense"):
        with pytest.raises((TypeError, ValueError)):
            b.gpu_spec(bad)
    assert {k: dataclasses.astuple(v) for k, v in b.GPUS.items()} == before


@pytest.mark.parametrize("device", ["NVIDIA H800 PCIe", "NVIDIA H20-3e", "NVIDIA A10",
                                    "NVIDIA A100 80GB PCIe", "NVIDIA H100",
                                    "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "AMD Instinct MI300A",
                                    "AMD Instinct MI325X", ""])
def test_device_names_without_a_preset_find_none(device):
    # Form factors with other memory or bandwidth are not folded into a preset.
    assert b.gpu_for_device_name(device) is None


def test_device_name_must_be_a_string():
    with pytest.raises(TypeError, match="device_name must be a str, got int 0"):
        b.gpu_for_device_name(0)
