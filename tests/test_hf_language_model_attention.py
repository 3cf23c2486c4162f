"""Registration judges a model by the attention its *language model* calls (the one ds_ring shards): a
vision-language model whose vision tower allows only eager (GOT-OCR2's SAM encoder) registers when its language model
calls the replaced entry, whatever the top-level config says; one whose language model stays eager is refused, and
the message names ``config.text_config`` and the fix (never "register 'eager'", which registration refuses). GOT-OCR2
and PP-Chart2Table equal the whole model on ring / zigzag / Ulysses: ``docs/vlm_zoo.md`` (``tests/test_vlm_zoo.py``).
"""

from __future__ import annotations

import warnings

import pytest

from ds_ring.integrations.hf.registration import _model_config
from tests import vlm_zoo, zoo


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_a_vision_tower_left_eager_does_not_stop_a_language_model_on_sdpa():
    model = vlm_zoo.build("got_ocr2")  # as transformers builds it: eager throughout
    _, refusal = _model_config(model, "sdpa")
    message = str(refusal)
    assert "model's config.text_config._attn_implementation 'eager'" in message
    assert "attn_implementation={'text_config': 'sdpa'}" in message
    assert "register 'eager'" not in message
    model.set_attn_implementation({"text_config": "sdpa"})
    assert model.config._attn_implementation == "eager"  # the top-level config: the SAM tower's
    assert _model_config(model, "sdpa")[1] is None


def test_a_language_model_left_eager_is_refused_whatever_the_top_level_config_says():
    model = vlm_zoo.build("llava", attention="sdpa")
    model.set_attn_implementation({"text_config": "eager"})
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"config.text_config._attn_implementation 'eager'"):
        raise _model_config(model, "sdpa")[1]


def test_a_text_model_is_named_by_its_own_config():
    _, refusal = _model_config(zoo.build("llama"), "sdpa")
    assert "does not match the model's config._attn_implementation 'eager'" in str(refusal)
    assert "register 'eager'" not in str(refusal)
