"""A prompt goes to a prefill node only when that node's cache can hold it (router/registry.py
`NodeEntry.holds`, asked by router/prefill.py): prefill and decode pools are sized apart (a prefill node at TP 1 beside a decode node
at TP 2 holds half the tokens on the same --kv-cache-memory), and a prompt that fits the decode
node but no prefill node was sent to a prefill node anyway, which refused it with a 400. Now a
larger prefill node takes it, or, with none, the decode node computes it itself."""

from __future__ import annotations

from proto import pb
from router.config import RouterConfig
from router.policy import make_policy
from router.prefill import PrefillPhase
from router.registry import NodeRegistry

BLOCK = 16


def _node(reg: NodeRegistry, node_id: str, kind, blocks: int):
    info = pb.NodeInfo(
        node_id=node_id,
        kind=kind,
        address=f"127.0.0.1:{len(reg.nodes) + 1}",
        incarnation=1,
        schema_digest="x",
        prefill_ready=kind == pb.NODE_KIND_PREFILL,
        capacity=pb.Capacity(total_blocks=blocks, free_blocks=blocks, block_size=BLOCK, total_slots=4, free_slots=4),
    )
    return reg.register(info)


def _cluster(**prefill_blocks: int):
    """A registry with a decode node of 300 pages and prefill nodes of these many pages; its
    PrefillPhase and the decode node."""
    reg = NodeRegistry()
    d = _node(reg, "d", pb.NODE_KIND_DECODE, 300)
    for name, blocks in prefill_blocks.items():
        _node(reg, name, pb.NODE_KIND_PREFILL, blocks)
    return PrefillPhase(RouterConfig(), reg, make_policy("least-loaded"), lambda coro: None), d


def test_a_prompt_no_prefill_node_holds_is_computed_on_the_decode_node():
    phase, d = _cluster(p=50)  # 50 pages of 16: prompts of up to 799 tokens (+ 1)
    assert phase.use_pool(d, 799)
    assert not phase.use_pool(d, 800)
    assert not phase.use_pool(d, 100, cached=700)  # the whole prompt counts, not what d would compute
    assert phase.choose(d, 800, set(), window=True) is None
    assert phase.choose(None, 800, set(), window=True) is None  # one that ends at its first token too
    chosen = phase.choose(d, 799, set(), window=True)
    assert chosen is not None and chosen[0].node_id == "p"


def test_a_larger_prefill_node_takes_what_a_smaller_one_cannot_hold():
    phase, d = _cluster(small=50, large=200)
    assert phase.use_pool(d, 1500)
    for _ in range(3):  # least-loaded would spread them: only `large` holds the prompt
        chosen = phase.choose(d, 1500, set(), window=False)
        assert chosen is not None and chosen[0].node_id == "large"


def test_a_prefill_node_before_its_capacity_is_known_takes_any_prompt():
    phase, d = _cluster(p=0)
    assert phase.use_pool(d, 4000)
