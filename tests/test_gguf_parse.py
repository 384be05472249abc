"""The quick GGUF parse a conversion uses reads exactly what gguf-py's reader reads (and the tensor
names' table it shares is the one gguf-py makes)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.models.gguf_parse import one_gguf_parse, plain_view_reader


def write_gguf(path: Path) -> Path:
    """Every kind of metadata a model's file carries (scalars, strings, string, float and int
    arrays like a tokenizer's) and tensors, one quantized."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("general.flag", True)
    writer.add_string("general.name", "tiny ünïcødé")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)] + ["▁é", "🚀", ""])
    writer.add_array("tokenizer.ggml.scores", [float(x) for x in rng.standard_normal(303)])
    writer.add_array("tokenizer.ggml.token_type", [int(x) for x in rng.integers(1, 6, 303)])
    writer.add_tensor("a.weight", rng.standard_normal((4, 8)).astype(np.float32))
    blocks = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("b.weight", blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_plain_view_reader_reads_the_same_fields_and_tensors(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "every-kind.gguf")
    slow, quick = gguf.GGUFReader(str(path)), plain_view_reader()(str(path))
    assert list(slow.fields) == list(quick.fields)
    for name, field in slow.fields.items():
        other = quick.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        assert len(field.parts) == len(other.parts), name
        for a, b in zip(field.parts, other.parts):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
            assert not isinstance(b, np.memmap)
        assert field.contents() == other.contents(), name
    assert quick.fields["tokenizer.ggml.tokens"].contents()[-3:] == ["▁é", "🚀", ""]
    assert [t.name for t in slow.tensors] == [t.name for t in quick.tensors]
    for a, b in zip(slow.tensors, quick.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.data_offset) == (b.tensor_type, b.shape.tolist(), b.data_offset)
        assert a.data.tobytes() == b.data.tobytes()


def test_within_one_parse_a_file_is_read_once_and_metadata_handed_out_as_copies(tmp_path: Path, monkeypatch) -> None:
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    path = write_gguf(tmp_path / "every-kind.gguf")
    loads = []
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint",
                        lambda p, return_tensors=False, **kw: loads.append(return_tensors) or {"config": {"n": [1]}})
    real_reader, real_load, real_name_map = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map
    with one_gguf_parse():
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)  # transformers asks once per module
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
        assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not names
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(str(tmp_path / "." / "every-kind.gguf")) is first  # one reader per file
        given = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)
        given["config"]["n"].append(2)  # a caller changing what it was given changes no other's
        assert hf_gguf.load_gguf_checkpoint(str(path))["config"] == {"n": [1]}
        hf_gguf.load_gguf_checkpoint(str(path), return_tensors=True)  # the weights: read, not cached
    assert loads == [False, True]
    assert (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map) == (
        real_reader, real_load, real_name_map)


@pytest.mark.parametrize("broken", [b"", b"GGUF\x63\x00\x00\x00"])
def test_a_broken_file_is_refused_as_gguf_py_refuses_it(tmp_path: Path, broken: bytes) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(broken + b"\x00" * 8)
    with pytest.raises(ValueError):
        gguf.GGUFReader(str(path))
    with pytest.raises(ValueError):
        plain_view_reader()(str(path))


def test_read_gguf_shares_the_conversions_reader_and_is_quick_elsewhere(tmp_path: Path) -> None:
    from tandem.models.gguf_parse import read_gguf

    path = write_gguf(tmp_path / "every-kind.gguf")
    alone = read_gguf(path)
    assert isinstance(alone, plain_view_reader()) and alone is not read_gguf(path)
    with one_gguf_parse():
        assert read_gguf(path) is read_gguf(path) is gguf.GGUFReader(str(path))


def test_a_gguf_py_whose_reader_is_built_another_way_keeps_its_own_reader(monkeypatch) -> None:
    from gguf.gguf_reader import GGUFReader

    monkeypatch.setattr(GGUFReader, "_get", lambda self, offset, dtype, count=1, order=None, extra=0: None)
    assert plain_view_reader.__wrapped__() is GGUFReader
