"""Blackwell (sm100, GB300's 10.3 included) body of the MLA decode attention: kernel_sm100.py's tcgen05 kernel,
launched by the policy's mla_decode tuning (tuning.json's "sm100" section; bodies.py has the op around it)."""

from pallas_kernels.mla_decode import bodies, kernel_sm100

ARCH = "sm100"
_BODY = bodies.Body(ARCH, kernel_sm100)
TUNING = bodies.load_tuning(ARCH)  # the default policy's entry (tests and benchmarks launch by it)


def load_tuning() -> dict:
    return bodies.load_tuning(ARCH)


def launch_for(q_lat_BTHR, q_pe_BTHE, entry, tuning=TUNING) -> kernel_sm100.Launch:
    return _BODY.launch_for(q_lat_BTHR, q_pe_BTHE, entry, tuning)


def mla_decode_attention(q_lat_BTHR, q_pe_BTHE, entry, key_len_BT, *, tuning=TUNING, **kw):
    """bodies.Body.mla_decode_attention on kernel_sm100.py (scale, kv_offset, return_lse, interpret as there)."""
    return _BODY.mla_decode_attention(q_lat_BTHR, q_pe_BTHE, entry, key_len_BT, tuning=tuning, **kw)


def ops(policy):
    """This body's op, launched by the policy's mla_decode tuning."""
    return _BODY.ops(policy, mla_decode_attention)
