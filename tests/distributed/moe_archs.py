"""Which tiny MoE architectures a test world's layout can build."""


def runs_at(arch: str, tp: int, ep: int) -> bool:
    """gpt-oss's biased experts need expert TP 1 (megatron's TransformerConfig asserts it); the test worlds give
    expert TP 1 only with EP > 1 (at EP 1 expert TP is TP, megatron's default). Its TP 2 case is TP 2 x EP 2."""
    return not (arch == "gpt_oss" and tp > 1 and ep == 1)
