"""Blackwell (sm100, GB300's 10.3 included) body of the MLA decode attention: kernel_sm100.py's tcgen05 kernel,
launched by the policy's mla_decode tuning (tuning.json's "sm100" section)."""

import json
import pathlib

from pallas_kernels.mla_decode import kernel_sm100

ARCH = "sm100"


def load_tuning() -> dict:
    return json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())[ARCH]


TUNING = load_tuning()  # the default policy's entry (tests and benchmarks launch by it)


def launch_for(q_lat_BTHR, q_pe_BTHE, entry, tuning=TUNING) -> kernel_sm100.Launch:
    B, T, H, R = q_lat_BTHR.shape
    rows = entry["rows"]
    return kernel_sm100.pick_launch(
        tuning, B, T, H, R, q_pe_BTHE.shape[-1], rows.shape[1], rows.dtype, q_lat_BTHR.dtype
    )


def mla_decode_attention(
    q_lat_BTHR, q_pe_BTHE, entry, key_len_BT, *, scale, kv_offset=0, return_lse=False, tuning=TUNING, interpret=None
):
    """The api's op on the kernel (same signature and result as reference.mla_decode_attention, plus the tuning
    entry and interpret for CPU tests); NotImplementedError for what the kernel does not take."""
    rows, scales = entry["rows"], entry.get("scales")
    launch = launch_for(q_lat_BTHR, q_pe_BTHE, entry, tuning)
    kernel_sm100.check_supported(q_lat_BTHR, q_pe_BTHE, rows, scales, launch)
    # the kernel clips lengths to 0 .. S itself: an XLA kernel before it only for a slice's offset
    lens_BT = key_len_BT if isinstance(kv_offset, int) and kv_offset == 0 else key_len_BT - kv_offset
    return kernel_sm100.attention(
        q_lat_BTHR,
        q_pe_BTHE,
        rows,
        scales,
        lens_BT,
        scale=float(scale),
        launch=launch,
        return_lse=return_lse,
        interpret=interpret,
    )


def ops(policy):
    """This body's op, launched by the policy's mla_decode tuning."""
    tuning = policy.table("mla_decode")[ARCH]

    def op(*args, **kwargs):
        return mla_decode_attention(*args, tuning=tuning, **kwargs)

    return op
