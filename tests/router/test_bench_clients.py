"""What benchmark clients (vLLM's `vllm bench serve`, guidellm, aiperf) read of the router before
and around their requests, replayed without the tools: the model card's `root`, from which
`vllm bench serve` without --model loads the tokenizer (docs/api.md)."""

from __future__ import annotations

from router.model_names import model_root
from tests.helpers.front_door import get


def test_model_cards_name_their_root_as_vllm_does(door):
    """`vllm bench serve` with no --model takes `data[0]["id"]` and `data[0]["root"]` of /v1/models
    and loads its tokenizer from the root; a card without it stopped the tool with KeyError 'root'."""
    r, _, _ = door
    status, listed = get(r.http_port, "/v1/models")
    assert status == 200, listed
    card = listed["data"][0]
    assert card["root"] == "/models/m" and card["parent"] is None, card  # the fake node's checkpoint
    status, one = get(r.http_port, f"/v1/models/{card['id']}")
    assert status == 200 and one["root"] == "/models/m", one


def test_a_hub_snapshot_is_rooted_at_its_repo_id():
    """A checkpoint from the Hugging Face cache is named by its repo id, which a client elsewhere
    can load a tokenizer from; any other checkpoint by its path."""
    snap = "/root/.cache/huggingface/hub/models--Qwen--Qwen3.5-0.8B/snapshots/0a1b2c3d"
    assert model_root(snap) == "Qwen/Qwen3.5-0.8B" and model_root(snap + "/") == "Qwen/Qwen3.5-0.8B"
    assert model_root("/data/ckpts/Qwen3.5-0.8B") == "/data/ckpts/Qwen3.5-0.8B"
