"""The Hugging Face family's recipes (families/hf/find.py): a module class's recipe finds its sites wherever a model
holds it, a hybrid's routers and recipe sites make one controller, mechanisms named but not audited become notices,
and a transformers model with no controller is refused in one line. The recipes of transformers' own architectures
are tested in test_hf_recipes_*.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fcaudit as fca
from fcaudit.families.hf import recipes
from fcaudit.families.hf.find import hf_controller
from harness import api_refusal

pytest.importorskip("transformers")


class SelectiveMixer(nn.Module):
    """A toy selective recurrence in the style of a state-space mixer: `select` makes each token's decay from its
    input; `mix` is applied through its weight, never called (as Mamba's torch path uses dt_proj)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.select, self.mix, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        decay = torch.sigmoid(self.select(x))  # [batch, token, d]: the controller
        u, state, outs = self.inp(x), torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            state = decay[:, t] * state + u[:, t]
            outs.append(state)
        return self.out(F.linear(torch.stack(outs, 1), self.mix.weight, self.mix.bias))


class Indexer(nn.Module):
    """Stands for a mechanism fcaudit names but has no kind for."""

    def forward(self, x):
        return x


class RecurrentLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, layers: int = 2):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(d), "mixer": SelectiveMixer(d)})
                                    for _ in range(layers))
        self.indexer = Indexer()

    def forward(self, ids):
        h = self.indexer(self.emb(ids))
        for layer in self.layers:
            h = h + layer["mixer"](layer["norm"](h))
        return self.head(h)


@pytest.fixture
def recipe(monkeypatch):
    monkeypatch.setitem(recipes.RECIPES, "SelectiveMixer", (recipes.Recipe("input-dependent decay", "select"),))
    monkeypatch.setitem(recipes.UNAUDITED, "Indexer", "key selection: fcaudit has no kind for it yet")


def _windows(vocab: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (4, 12), generator=g), torch.randint(0, vocab, (4, 12), generator=g)


def test_a_recipe_finds_its_class_anywhere_audits_it_exactly_and_names_what_it_skips(recipe, tmp_path):
    torch.manual_seed(0)
    model = RecurrentLM().eval()
    ctrl = fca.controller_for(model)
    assert [s.name for s in ctrl.sites] == ["layers.0.mixer.select", "layers.1.mixer.select"]
    assert {s.kind for s in ctrl.sites} == {"vector_gate"} and "input-dependent decay" in ctrl.description
    assert ctrl.notes == ("not audited: 1 Indexer (indexer): key selection: fcaudit has no kind for it yet",)
    ev, ca = _windows()
    res = fca.audit(model, ctrl, ev, ca, randomizations=2, out=tmp_path / "a", batch_size=2, quiet=True)
    assert res.replay.bit_equal
    assert any("Indexer" in f.line and not f.refusal for f in res.replay.findings)
    assert res.penalties().to_frame().loc["CrossInput", "statistic"] != 0  # the decays matter


def test_a_module_used_through_its_weight_is_not_read_as_skipped_work(recipe):
    torch.manual_seed(0)
    model = RecurrentLM().eval()
    r = fca.execution(model, fca.controller_for(model), _windows()[0], min_run_time=0.01, decode=False)
    # `mix` is never called: its rows are 0 live and with nothing decided away, so it is no evidence of a skip
    assert (r.decided, r.executed) == (1.0, 1.0)


def test_a_recipe_whose_module_is_gone_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(recipes.RECIPES, "SelectiveMixer", (recipes.Recipe("decay", "gate_proj"),))
    with pytest.raises(fca.FcauditError, match=r"^SelectiveMixer at layers.0.mixer has no submodule 'gate_proj'") as e:
        hf_controller(RecurrentLM())
    assert "\n" not in str(e.value)


def test_a_transformers_model_without_a_controller_is_refused_naming_the_route(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(fca.FcauditError, match="LlamaForCausalLM has no controller fcaudit finds .*from_modules") as e:
        fca.controller_for(model)
    assert "\n" not in str(e.value)


def test_execution_takes_a_checkpoint_that_states_no_context(tmp_path):
    """A state-space model's config.json has no max_position_embeddings: any window runs, so none is refused."""
    from fcaudit.execution.measure import _block_size, default_window

    (tmp_path / "config.json").write_text('{"model_type": "mamba", "hidden_size": 16}')
    assert _block_size(tmp_path) is None and default_window([None, 64]) == 64 and default_window([None]) == 2048
    (tmp_path / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": true}')
    with pytest.raises(fca.FcauditError, match="has no valid block_size"):
        _block_size(tmp_path)


def test_a_checkpoint_whose_layers_are_named_layer_n_is_read_for_its_depth(tmp_path):
    """BERT-style decoders keep their blocks under encoder.layer.N: the depth check counts them, so the refusal is
    that the model has no controller, not that its weights hold 0 layers."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, is_decoder=True)
    transformers.BertLMHeadModel(cfg).save_pretrained(tmp_path / "bert")
    with pytest.raises(fca.FcauditError, match="BertLMHeadModel has no controller fcaudit finds"):
        fca.controller_for(fca.load(tmp_path / "bert"))


def test_a_checkpoint_whose_layers_are_lists_of_their_parts_is_read_for_its_depth_and_missing_layers_are_caught(
        tmp_path):
    """XLM keeps each layer's parts in lists of their own (transformer.attentions.N, transformer.ffns.N): the depth
    check reads 3 layers from them, so the refusal is that the model has no controller; a config.json asking for
    more layers than the weights hold is still refused before any module is built."""
    import json

    import transformers

    cfg = transformers.XLMConfig(vocab_size=64, emb_dim=16, n_layers=3, n_heads=2, max_position_embeddings=32,
                                 is_decoder=True)
    transformers.XLMWithLMHeadModel(cfg).save_pretrained(tmp_path / "xlm")
    assert api_refusal(lambda: fca.controller_for(fca.load(tmp_path / "xlm"))).startswith(
        "XLMWithLMHeadModel has no controller fcaudit finds")
    config = json.loads((tmp_path / "xlm" / "config.json").read_text())
    (tmp_path / "xlm" / "config.json").write_text(json.dumps({**config, "n_layers": 5}))
    assert "(num_hidden_layers=5, the weights hold 3 layers)" in api_refusal(lambda: fca.load(tmp_path / "xlm"))
