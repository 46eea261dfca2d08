"""URLs as SRC and DST (``core/storage.py``): parsing, options, retries, and what a failed request says.

The failures are the ones s3fs itself raises: botocore's ``ClientError`` for the S3 error
codes, turned into Python exceptions by s3fs's own ``translate_boto_error``.
"""

from __future__ import annotations

import errno

import pytest
from object_store import own_tmpdir  # noqa: F401 - the fixture

from shardckpt.core import storage, uploads
from shardckpt.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_IO,
    EXIT_USAGE,
    BadInputError,
    IOFailure,
    UsageError,
)
from shardckpt.core.storage import is_url, local_form, parse_options, retried, store_error

pytestmark = pytest.mark.usefixtures("own_tmpdir")


def s3_error(code: str, status: int) -> OSError:
    """Return what s3fs raises for an S3 error ``code`` answered with HTTP ``status``."""
    s3fs_errors = pytest.importorskip("s3fs.errors")
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": f"{code} said the server"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return s3fs_errors.translate_boto_error(ClientError(response, "GetObject"))


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("s3://bucket/run/step-100", True),
        ("gs://b/x", True),
        ("memory://x", True),
        ("/local/path", False),
        ("relative/dir", False),
        ("s3:/bucket/x", False),
        ("c:/windows", False),
        ("file:///tmp/ckpt", False),
    ],
)
def test_a_url_is_told_from_a_path(text, url):
    assert is_url(text) is url


def test_a_file_url_is_the_local_path_it_names():
    assert local_form("file:///tmp/ckpt") == "/tmp/ckpt"
    assert local_form("s3://b/x") == "s3://b/x"
    assert local_form("/tmp/x") == "/tmp/x"


def test_storage_options_are_json_values_and_dotted_keys_nest():
    options = parse_options(
        ["anon=true", "default_block_size=8388608", "client_kwargs.region_name=eu-west-1", "x=a=b"]
    )
    assert options == {
        "anon": True,
        "default_block_size": 8388608,
        "client_kwargs": {"region_name": "eu-west-1"},
        "x": "a=b",
    }


@pytest.mark.parametrize("pair", ["anon", "=true", ""])
def test_a_storage_option_that_is_not_key_value_is_a_usage_error(pair):
    with pytest.raises(UsageError) as caught:
        parse_options([pair])
    assert caught.value.exit_code == EXIT_USAGE
    assert caught.value.line() == (
        f"--storage-option {pair!r} is not KEY=VALUE: write it like --storage-option anon=true"
    )


def test_a_request_that_fails_then_succeeds_is_retried():
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise s3_error("SlowDown", 503)
        return "done"

    assert retried(flaky, "s3://b/x", pause=0) == "done"
    assert len(calls) == 3


def tries(error: BaseException, url: str, *, writing: bool = False) -> tuple[int, IOFailure]:
    """Return how many times ``retried`` made a request that always raises ``error``, and its line."""
    calls = []

    def request() -> None:
        calls.append(1)
        raise error

    with pytest.raises(IOFailure) as caught:
        retried(request, url, writing=writing, pause=0)
    return len(calls), caught.value


def test_a_request_that_keeps_failing_is_tried_a_bounded_number_of_times_then_one_line():
    url = "s3://b/run/__0_0.distcp"
    calls, error = tries(s3_error("InternalError", 500), url, writing=True)
    assert calls == storage.RETRIES + 1
    assert error.exit_code == EXIT_IO
    assert error.line() == (
        f"'{url}': writing failed after {storage.RETRIES + 1} tries "
        "(500 InternalError): check the endpoint (AWS_ENDPOINT_URL) and the network, and run again"
    )


def test_access_denied_is_not_retried_and_is_exit_4():
    calls, error = tries(s3_error("AccessDenied", 403), "s3://b/x")
    assert calls == 1
    assert error.exit_code == EXIT_IO
    assert error.line().startswith("'s3://b/x': access denied (403 AccessDenied): check")


def test_a_missing_source_is_exit_3_and_a_missing_bucket_for_dst_exit_4():
    missing = s3_error("NoSuchKey", 404)
    read = store_error(missing, "s3://b/x")
    assert isinstance(read, BadInputError) and read.exit_code == EXIT_BAD_INPUT
    assert read.line() == (
        "'s3://b/x': no such object or prefix (404 NoSuchKey): check the URL of the "
        "checkpoint (and the bucket's name)"
    )
    write = store_error(s3_error("NoSuchBucket", 404), "s3://b/x", writing=True)
    assert write.exit_code == EXIT_IO
    assert write.line().startswith("'s3://b/x': no such bucket (404 NoSuchBucket)")


def test_an_unreachable_store_is_said_at_once_not_retried():
    """What s3fs raises for a refused connection: botocore's error, raised from the OS's."""
    from botocore.exceptions import EndpointConnectionError

    refused = EndpointConnectionError(endpoint_url="http://127.0.0.1:1/b/x")
    refused.__cause__ = ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")
    calls, error = tries(refused, "s3://b/x")
    assert calls == 1
    assert error.line() == (
        "'s3://b/x': cannot reach the store (Could not connect to the endpoint URL: "
        '"http://127.0.0.1:1/b/x"): check the endpoint (AWS_ENDPOINT_URL) and the network, '
        "and run again"
    )


def test_a_full_local_disk_is_said_at_once_naming_tmpdir():
    calls, error = tries(OSError(errno.ENOSPC, "No space left on device"), "s3://b/run")
    assert calls == 1
    assert error.line() == (
        "'s3://b/run': no space left on the local disk for its copy: free space in $TMPDIR, "
        "or point TMPDIR at a larger disk: a URL's checkpoint is copied there (docs/storage.md)"
    )


def test_an_os_error_without_a_response_is_named_by_its_text():
    error = store_error(OSError(errno.EIO, "Input/output error"), "s3://b/x")
    assert error.exit_code == EXIT_IO
    assert error.line().startswith("'s3://b/x': reading failed after 5 tries ([Errno 5] Input")


def test_a_url_without_a_bucket_is_a_usage_error():
    pytest.importorskip("s3fs")
    with pytest.raises(UsageError) as caught:
        storage.open_store("s3://", {})
    assert caught.value.line() == "'s3://': names no bucket: write it as s3://bucket/prefix"


def test_a_dcp_round_trips_through_fsspecs_memory_store(tmp_path, capsys):
    """Any fsspec protocol, not only S3: the in-process ``memory://`` store, read back by torch."""
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from shardckpt.cli.app import run

    torch.manual_seed(0)
    sd = {"model": {"w": torch.randn(16, 8), "b": torch.randn(8)}, "step": 7}
    dcp.save(sd, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    memory = fsspec.filesystem("memory")
    root = f"memory://shardckpt-test-{tmp_path.name}"
    argv = ["convert", tmp_path / "ckpt", f"{root}/at-2", "--to", "sharded", "--world-size", "2"]
    assert run([str(a) for a in [*argv, "-q"]]) == 0
    names = sorted(p.rsplit("/", 1)[1] for p in memory.find(f"{root}/at-2"))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert memory.find(root) == sorted(memory.find(f"{root}/at-2"))  # no marker left beside
    back = {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8)}, "step": 0}
    dcp.load(back, storage_reader=FsspecReader(f"{root}/at-2"), no_dist=True)
    assert torch.equal(back["model"]["w"], sd["model"]["w"]) and back["step"] == 7
    assert run(["convert", f"{root}/at-2", str(tmp_path / "full.pt"), "--to", "full", "-q"]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(full["model"]["b"], sd["model"]["b"])
    assert run(["convert", f"{root}/at-2", f"{root}/at-2", "--to", "full"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shardckpt: error: '{root}/at-2': DST is SRC, inside it or around it: "
        "name a prefix beside the checkpoint for the output"
    ]
    memory.rm(root, recursive=True)


def test_commit_objects_come_last_at_any_depth_deepest_first():
    names = [
        ".metadata",
        "__0_0.distcp",
        "model/.metadata",
        "model/__0_0.distcp",
        "optim/sub/.metadata",
        "metadata.json",
        "notes/x.metadata",
    ]
    assert uploads.commit_objects(names, (".metadata", "metadata.json")) == [
        "optim/sub/.metadata",
        "model/.metadata",
        ".metadata",
        "metadata.json",
    ]
    assert uploads.commit_objects(names, ("model/.metadata",)) == ["model/.metadata"]
    assert uploads.commit_objects(names, ()) == []


def test_an_accelerate_like_tree_uploads_every_dcp_metadata_after_all_data(tmp_path, monkeypatch):
    """The order the objects reach the store in: every ``.metadata`` after every data file."""
    import fsspec

    local = tmp_path / "out"
    for name in ("model/__0_0.distcp", "model/.metadata", "optim/__0_0.distcp", "random.pkl"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(b"x")
    (local / "optim" / ".metadata").write_bytes(b"m")
    store = storage.open_store(f"memory://order-{tmp_path.name}/out", {})
    memory = fsspec.filesystem("memory")
    order: list[list[str]] = []
    put = type(memory).put
    monkeypatch.setattr(
        type(memory),
        "put",
        lambda fs, lpath, rpath, **kw: order.append(rpath) or put(fs, lpath, rpath, **kw),
    )
    uploads.upload(local, store, (".metadata",), overwrite=False)
    root = store.path
    assert order == [
        [f"{root}/model/__0_0.distcp", f"{root}/optim/__0_0.distcp", f"{root}/random.pkl"],
        [f"{root}/model/.metadata"],  # one after another, in their order
        [f"{root}/optim/.metadata"],
    ]
    assert memory.cat_file(f"{root}/optim/.metadata") == b"m"
    assert not memory.exists(store.beside(".out.shardckpt-partial"))
    memory.rm(root.rsplit("/", 1)[0], recursive=True)


def test_per_rank_and_deepspeed_files_are_read_in_place_and_the_rest_fetched():
    # The readers of per-rank files (fsdp2-ranks, fsdp1-*, veRL's model and optimizer
    # files; by every name formats/ranks/rank_names.py reads, .bin and __R_0.pt too) and
    # of DeepSpeed's states files read them by ranges; every other trainer's torch.save
    # (veRL's extra_state files, a universal checkpoint's without its
    # zero/optimizer_state.pt, rank files in a subdirectory, which no reader reads) and
    # the small objects beside them are fetched whole.
    store = storage.Store("s3://b/run", None, "b/run")
    objects = dict.fromkeys(
        [
            "rank0.pt",
            "rank_1.pth",
            "model_rank2.pt",
            "rank3-of-4.pt",
            "model_world_size_2_rank_0.pt",
            "optim_world_size_2_rank_0.pt",
            "extra_state_world_size_2_rank_0.pt",
            "sub/rank0.pt",
            "mp_rank_00_model_states.pt",
            "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",
            "global_step3/zero/embed.weight/fp32.pt",
            "pytorch_model_fsdp_rank0.bin",
            "frank0.pt",
            "rank_2.bin",
            "__1_0.pt",
            "__1_1.pt",
            "rank.pt",
            "common.pt",
            "latest",
            "__0_0.distcp",
        ],
        1,
    )
    assert sorted(storage.read_in_place(store, objects)) == [
        "__0_0.distcp",
        "__1_0.pt",
        "frank0.pt",
        "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "model_rank2.pt",
        "model_world_size_2_rank_0.pt",
        "mp_rank_00_model_states.pt",
        "optim_world_size_2_rank_0.pt",
        "pytorch_model_fsdp_rank0.bin",
        "rank0.pt",
        "rank3-of-4.pt",
        "rank_1.pth",
        "rank_2.bin",
    ]


def test_every_name_the_per_rank_readers_read_is_read_in_place():
    from shardckpt.formats.ranks.rank_names import parse_rank_name

    names = ["rank3.pt", "rank_3.bin", "rank-3.pth", "model_rank3.pt", "rank3-of-4.bin"]
    names += ["__3_0.pt", "__3_0.bin", "pytorch_model_fsdp_rank3.bin", "frank3.pt"]
    others = ["__3_1.pt", "rank.pt", "rank3.safetensors", "ranks.pt", "rank3.pt.tmp"]
    assert all(parse_rank_name(name) for name in names)
    assert not any(parse_rank_name(name) for name in others)
    assert all(storage.RANK_FILE.fullmatch(name) for name in names)
    assert not any(storage.RANK_FILE.fullmatch(name) for name in others)


def test_torch_checkpointings_items_are_read_in_place():
    store = storage.Store("s3://b/tcp", None, "b/tcp")
    objects = dict.fromkeys(
        ["metadata.pkl", "model_0.safetensors", "optim_0.pt", "x/y.safetensors", "x/z_0.pt"], 1
    )
    assert storage.read_in_place(store, objects) == ["model_0.safetensors", "optim_0.pt"]
    # Without its metadata.pkl, a directory of safetensors beside a .pt is a trainer's: fetched.
    del objects["metadata.pkl"]
    assert storage.read_in_place(store, objects) == []


def test_a_universal_checkpoints_files_are_read_in_place_beside_its_optimizer_state():
    store = storage.Store("s3://b/u", None, "b/u")
    files = ["zero/fc.weight/fp32.pt", "zero/fc.weight/exp_avg.pt", "zero/optimizer_state.pt"]
    tagged = [f"global_step3/{f}" for f in files]
    objects = dict.fromkeys([*tagged, "global_step3/mp_rank_00_model_states.pt"], 1)
    objects |= dict.fromkeys(["latest_universal", "other/zero/fc.weight/fp32.pt"], 1)
    assert sorted(storage.read_in_place(store, objects)) == sorted(
        [*tagged, "global_step3/mp_rank_00_model_states.pt"]
    )
    # Without zero/optimizer_state.pt beside them, files under a zero/ are no universal checkpoint's.
    del objects["global_step3/zero/optimizer_state.pt"]
    assert storage.read_in_place(store, objects) == ["global_step3/mp_rank_00_model_states.pt"]


TRAINER_STATE = ["scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"]


def test_a_trainer_checkpoints_weights_are_read_in_place_its_optimizer_never_fetched():
    # hf reads a Trainer's checkpoint-N: its shards by ranges; its optimizer.pt it carries
    # unread (a stand-in: nothing fetched); its small state (scheduler, RNG, args) fetched.
    store = storage.Store("s3://b/checkpoint-4", None, "b/checkpoint-4")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = [*shards, "model.safetensors.index.json", "config.json", "optimizer.pt"]
    objects = dict.fromkeys([*names, *TRAINER_STATE, "rng_state_1.pth", "scaler.pt"], 1)
    assert sorted(storage.read_in_place(store, objects)) == [*shards, "optimizer.pt"]
    # Without trainer_state.json it is no Trainer's: an optimizer.pt there is fetched.
    del objects["trainer_state.json"]
    assert sorted(storage.read_in_place(store, objects)) == shards
    # With DeepSpeed's run beside it, the Trainer's model.safetensors is carried by the
    # DeepSpeed reader: fetched, as a trainer's directory's are.
    objects = dict.fromkeys(
        [
            "model.safetensors",
            *TRAINER_STATE,
            "latest",
            "global_step3/mp_rank_00_model_states.pt",
            "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ],
        1,
    )
    assert sorted(storage.read_in_place(store, objects)) == [
        "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step3/mp_rank_00_model_states.pt",
    ]


def test_an_fsdp_trainer_checkpoints_weights_are_read_in_place_its_optimizer_bin_never_fetched():
    # Under FSDP with full state dicts a Trainer saves optimizer.bin and FSDP's copy of
    # the model, pytorch_model_fsdp.bin, beside model.safetensors (no random_states_R.pkl):
    # hf reads the weights by ranges and carries both unread (stand-ins: nothing fetched).
    store = storage.Store("s3://b/checkpoint-2", None, "b/checkpoint-2")
    data = ["model.safetensors", "optimizer.bin", "pytorch_model_fsdp.bin"]
    objects = dict.fromkeys([*data, *TRAINER_STATE, "config.json"], 1)
    assert sorted(storage.read_in_place(store, objects)) == data
    # Without trainer_state.json it is no Trainer's: those .bin files are fetched.
    del objects["trainer_state.json"]
    assert storage.read_in_place(store, objects) == ["model.safetensors"]
    # With a random_states_R.pkl it is accelerate's save_state: its reader reads them all.
    objects["random_states_0.pkl"] = 1
    assert sorted(storage.read_in_place(store, objects)) == data


def test_an_accelerate_directorys_model_and_optimizer_files_are_read_in_place():
    # accelerate's reader reads them with the safetensors and torch.save readers, by
    # ranges; its scheduler, scaler, sampler and RNG files are fetched.
    store = storage.Store("s3://b/acc", None, "b/acc")
    data = ["model.safetensors", "model_1.safetensors", "pytorch_model_fsdp.bin"]
    data += ["pytorch_model_2.bin", "optimizer.bin", "optimizer_1.bin"]
    small = ["scheduler.bin", "scaler.pt", "sampler.bin", "dl_state_dict.bin"]
    small += ["random_states_0.pkl", "random_states_1.pkl", "custom_checkpoint_0.pkl"]
    objects = dict.fromkeys([*data, *small, "sub/optimizer.bin"], 1)
    assert sorted(storage.read_in_place(store, objects)) == sorted(data)
    # Without a random_states file it is no save_state's: its .bin files are fetched.
    objects = {k: v for k, v in objects.items() if not k.startswith("random_states")}
    assert storage.read_in_place(store, objects) == []
