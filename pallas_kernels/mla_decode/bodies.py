"""What the Hopper (sm90.py) and Blackwell (sm100.py) bodies of the MLA decode attention share: the api's op
around a kernel module (kernel.py, kernel_sm100.py: pick_launch, check_supported, attention), launched by the
body's tuning.json section."""

import dataclasses
import functools
import json
import pathlib
from types import ModuleType


def load_tuning(arch: str) -> dict:
    return json.loads((pathlib.Path(__file__).parent / "tuning.json").read_text())[arch]


@dataclasses.dataclass(frozen=True)
class Body:
    arch: str  # its tuning.json section
    kernel: ModuleType

    def launch_for(self, q_lat_BTHR, q_pe_BTHE, entry, tuning):
        B, T, H, R = q_lat_BTHR.shape
        rows = entry["rows"]
        E, S = q_pe_BTHE.shape[-1], rows.shape[1]
        return self.kernel.pick_launch(tuning, B, T, H, R, E, S, rows.dtype, q_lat_BTHR.dtype)

    def mla_decode_attention(
        self, q_lat_BTHR, q_pe_BTHE, entry, key_len_BT, *, scale, kv_offset=0, return_lse=False, tuning, interpret=None
    ):
        """The api's op on the kernel (same signature and result as reference.mla_decode_attention, plus the
        tuning entry and interpret for CPU tests); NotImplementedError for what the kernel does not take."""
        rows, scales = entry["rows"], entry.get("scales")
        launch = self.launch_for(q_lat_BTHR, q_pe_BTHE, entry, tuning)
        self.kernel.check_supported(q_lat_BTHR, q_pe_BTHE, rows, scales, launch)
        # the kernel clips lengths to 0 .. S itself: an XLA kernel before it only for a slice's offset
        lens_BT = key_len_BT if isinstance(kv_offset, int) and kv_offset == 0 else key_len_BT - kv_offset
        return self.kernel.attention(
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

    def ops(self, policy, op):
        """op (the body's mla_decode_attention), launched by the policy's mla_decode tuning."""
        return functools.partial(op, tuning=policy.table("mla_decode")[self.arch])
