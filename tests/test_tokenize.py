import pytest

from pipeline.steps.tokenize import (
    EOT,
    TokenizeConfig,
    TokenizeDocs,
    load_tokenizer,
    split_of,
    token_dtype,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(ccnet_texts):
    return train_tokenizer(ccnet_texts, TokenizeConfig(vocab_size=600, min_frequency=2))


def test_trained_bpe_round_trips_text_and_has_eot(tokenizer, ccnet_texts):
    assert tokenizer.token_to_id(EOT) == 0
    assert 256 < tokenizer.get_vocab_size() <= 600
    for text in ccnet_texts[:5]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text  # byte-level: lossless


def test_each_document_ends_with_eot_and_gets_a_split(tokenizer, ccnet_texts):
    docs = [{"warc_record_id": f"<id-{i}>", "text": t} for i, t in enumerate(ccnet_texts)]
    TokenizeDocs(tokenizer.to_str(), TokenizeConfig(val_fraction=0.3))(docs)
    for d in docs:
        assert d["tokens"][-1] == 0 and 0 not in d["tokens"][:-1]
        assert tokenizer.decode(d["tokens"][:-1]) == d["text"]
    assert {d["split"] for d in docs} == {"train", "val"}


def test_split_is_a_pure_function_of_record_id_and_seed():
    ids = [f"<urn:uuid:{i}>" for i in range(20000)]
    splits = [split_of(i, 0.1, seed=0) for i in ids]
    assert splits == [split_of(i, 0.1, seed=0) for i in ids]
    assert 0.09 < splits.count("val") / len(ids) < 0.11
    assert splits != [split_of(i, 0.1, seed=1) for i in ids]
    assert all(split_of(i, 0.0, 0) == "train" for i in ids[:100])


def test_dtype_follows_vocab_size():
    assert token_dtype(8192).name == "uint16" and token_dtype(65536).name == "uint16"
    assert token_dtype(65537).name == "uint32"


def test_loading_a_tokenizer_without_eot_is_refused(tmp_path, ccnet_texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(ccnet_texts, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="no '<\\|endoftext\\|>' token"):
        load_tokenizer(path)


def test_a_tokenizer_is_loaded_from_another_runs_output_in_a_bucket(tokenizer, monkeypatch):
    # A mixture's later sources load the first source's tokenizer.json where the job wrote it: in object storage
    # when its root is a bucket.
    from remote_servers import make_bucket, moto_server, use_s3_endpoint

    with moto_server() as endpoint:
        use_s3_endpoint(monkeypatch, endpoint)
        make_bucket(endpoint, "runs").put_object(Bucket="runs", Key="curate/k/tokenizer.json", Body=tokenizer.to_str())
        loaded = load_tokenizer("s3://runs/curate/k/tokenizer.json")
    assert loaded.to_str() == tokenizer.to_str() and loaded.token_to_id(EOT) == 0
