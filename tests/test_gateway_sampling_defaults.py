"""A request's sampling defaults from the model's generation_config.json (gateway.sampling_defaults):
read as vLLM reads them, values a request could not send left out, a request's own fields winning,
and ``--generation-config none`` keeping OpenAI's defaults, through a running gateway."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from gateway.sampling_defaults import SamplingDefaults
from gateway.served_model import ServedModel
from gateway.validation import RequestFields, RequestValidator
from gateway_fakes import fake_stack, tokenizer  # noqa: F401 (a fixture)

TUNED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "typical_p": 0.95,
         "repetition_penalty": 1.05, "max_new_tokens": 512, "bos_token_id": 2}


def written(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_fields_tandem_honours_are_read_and_nothing_else(tmp_path) -> None:
    defaults = SamplingDefaults.of_checkpoint(written(tmp_path, TUNED))
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, typical_p=0.95,
                                        repetition_penalty=1.05)
    assert defaults.given() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "typical_p": 0.95,
                                "repetition_penalty": 1.05}
    # A checkpoint saved by transformers without sampling settings (the tiny test models', a converted GGUF's)
    assert SamplingDefaults.of_checkpoint(written(tmp_path / "plain", {"bos_token_id": 2, "use_cache": True})).given() == {}
    assert SamplingDefaults.of_checkpoint(tmp_path / "missing") == SamplingDefaults()


def test_values_a_request_could_not_send_are_left_out_and_logged(tmp_path, caplog) -> None:
    odd = {"temperature": 3.0, "top_p": 0, "top_k": -1, "min_p": "0.1", "typical_p": 0.0, "repetition_penalty": 0.0,
           "do_sample": False}
    with caplog.at_level(logging.WARNING, logger="gateway.sampling_defaults"):
        assert SamplingDefaults.of_checkpoint(written(tmp_path, odd)) == SamplingDefaults()
    assert sum("is not a value a request may send" in r.message for r in caplog.records) == 6
    assert SamplingDefaults.of_checkpoint(written(tmp_path / "list", [1, 2])) == SamplingDefaults()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="gateway.sampling_defaults"):
        assert SamplingDefaults.of_checkpoint(tmp_path / "broken") == SamplingDefaults()
    assert "cannot read" in caplog.records[-1].message


def test_a_request_gets_the_defaults_for_what_it_leaves_out_and_keeps_what_it_sends(tokenizer) -> None:
    validator = RequestValidator(ServedModel("tiny", tokenizer, 64), 16,
                                 SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, typical_p=0.95,
                                                  repetition_penalty=1.05))
    left_out = validator.validate(RequestFields(prompt="hi"))
    assert (left_out.sampling.temperature, left_out.sampling.top_p, left_out.sampling.top_k,
            left_out.sampling.min_p, left_out.sampling.typical_p,
            left_out.repetition_penalty) == (0.6, 0.9, 20, 0.05, 0.95, 1.05)
    sent = validator.validate(RequestFields(prompt="hi", temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                            typical_p=1.0, repetition_penalty=1.0))
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.top_k, sent.sampling.min_p,
            sent.sampling.typical_p, sent.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0, 1.0)
    openai = RequestValidator(ServedModel("tiny", tokenizer, 64), 16).validate(RequestFields(prompt="hi"))
    assert (openai.sampling.temperature, openai.sampling.top_p, openai.sampling.top_k, openai.sampling.min_p,
            openai.sampling.typical_p, openai.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0, 1.0)


@pytest.mark.parametrize("generation_config", ["auto", "none"])
async def test_a_gateway_takes_its_models_defaults_unless_told_not_to(tokenizer, tiny_dir, tmp_path,  # noqa: F811
                                                                     generation_config) -> None:
    model_dir = tmp_path / "tuned"
    shutil.copytree(tiny_dir, model_dir)
    written(model_dir, {**json.loads((tiny_dir / "generation_config.json").read_text()), **TUNED})
    async with fake_stack(tokenizer, str(model_dir), generation_config=generation_config) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "temperature": 0}):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                params = stack.model.prefilled[-1]
                sampling = (params.sampling.temperature, params.sampling.top_k, params.repetition_penalty)
                if "temperature" in body:
                    assert sampling[0] == 0.0  # greedy as asked
                elif generation_config == "auto":
                    assert sampling == (pytest.approx(0.6), 20, pytest.approx(1.05))
                else:
                    assert sampling == (1.0, 0, 1.0)
        await stack.wait_until_idle()
