"""The prefill-to-decode channel over real sockets: blocks land per layer, and another model's KV,
a corrupt byte, a truncated stream or a silent sender fail the transfer instead of landing."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import numpy as np
import pytest
import xxhash

from kvhive.connector.disagg.incoming import TransferTable
from kvhive.connector.disagg.params import KVTransferParamsError, parse_kv_transfer_params
from kvhive.connector.disagg.transport import TcpReceiver, TcpSendChannel, TransferRefused
from kvhive.connector.disagg.wire import WireError, encode_layer, send_frame
from kvhive.store.key import KeySpace

LAYERS, HASHES = 2, [bytes([i]) * 16 for i in range(4)]
SPACE = KeySpace("model-a", 1, "float32", 4)


def _blocks(n, fill=1.0):
    return [memoryview(np.full(8, fill + i, dtype=np.float32)).cast("B") for i in range(n)]


@pytest.fixture()
def receiver():
    table = TransferTable(LAYERS, buffer_bytes=1 << 20, unclaimed_ttl_s=60)
    rx = TcpReceiver("127.0.0.1", 0, SPACE, table, timeout_s=2, held_blocks=lambda hashes: 1)
    yield rx
    rx.close()


def _channel(rx, space=SPACE):
    return TcpSendChannel(("127.0.0.1", rx.port), space, LAYERS, timeout_s=2)


def test_layers_land_and_held_blocks_are_skipped(receiver):
    channel = _channel(receiver)
    assert channel.open("t1", HASHES) == 1                  # the decode side holds block 0
    transfer = receiver.table.claim("t1")
    for layer in range(LAYERS):
        channel.send_layer(layer, 1, SPACE.keys(HASHES[1:]), _blocks(3, 10.0 * layer))
    channel.end(4)
    never = lambda: False  # noqa: E731
    assert receiver.table.wait_layer(transfer, 1, 1, 3, 2, never)
    got = np.frombuffer(transfer.layers[1][3], dtype=np.float32)
    assert got.tolist() == [12.0] * 8
    assert receiver.received_blocks == 3


def test_another_models_kv_is_refused_at_the_hello(receiver):
    with pytest.raises(TransferRefused, match="another model"):
        _channel(receiver, KeySpace("model-b", 1, "float32", 4)).open("t2", HASHES)


def _raw_transfer(rx, transfer_id):
    sock = socket.create_connection(("127.0.0.1", rx.port))
    send_frame(sock, {"type": "hello", "transfer_id": transfer_id, "key_prefix": SPACE.prefix,
                      "num_layers": LAYERS, "hashes": HASHES})
    sock.recv(4096)
    return sock, rx.table.claim(transfer_id)


def _failed(rx, transfer):
    assert not rx.table.wait_layer(transfer, 0, 1, 3, 2, lambda: False)
    return transfer.state == "failed" and not any(transfer.layers[0])


def test_a_corrupt_block_fails_the_transfer(receiver):
    sock, transfer = _raw_transfer(receiver, "t3")
    body = b"".join(bytes(p) for p in encode_layer(SPACE.keys(HASHES[1:]), _blocks(3)))
    corrupt = bytearray(body)
    corrupt[-3] ^= 0xFF
    send_frame(sock, {"type": "layer", "layer": 0, "first_block": 1, "count": 3}, [bytes(corrupt)])
    assert _failed(receiver, transfer)
    sock.close()


def test_a_block_under_another_key_fails_the_transfer(receiver):
    sock, transfer = _raw_transfer(receiver, "t4")
    other = KeySpace("model-b", 1, "float32", 4)
    send_frame(sock, {"type": "layer", "layer": 0, "first_block": 1, "count": 3},
               encode_layer(other.keys(HASHES[1:]), _blocks(3)))
    assert _failed(receiver, transfer)
    sock.close()


def test_a_truncated_stream_fails_the_transfer(receiver):
    sock, transfer = _raw_transfer(receiver, "t5")
    body = b"".join(bytes(p) for p in encode_layer(SPACE.keys(HASHES[1:]), _blocks(3)))
    # The frame written by hand, stopping half way through its body.
    header = msgpack.packb({"type": "layer", "layer": 0, "first_block": 1, "count": 3, "body_len": len(body)})
    sock.sendall(struct.pack("<I", len(header)) + header + struct.pack("<Q", xxhash.xxh3_64_intdigest(header)))
    sock.sendall(body[:len(body) // 2])
    sock.close()
    assert _failed(receiver, transfer)


def test_a_silent_sender_fails_at_the_deadline(receiver):
    sock, transfer = _raw_transfer(receiver, "t6")
    assert not receiver.table.wait_layer(transfer, 0, 1, 3, 0.2, lambda: False)
    assert transfer.state == "failed"
    sock.close()


def test_a_frame_with_a_bad_header_checksum_is_a_wire_error():
    from kvhive.connector.disagg.wire import recv_frame

    a, b = socket.socketpair()
    a.sendall(b"\x04\x00\x00\x00abcd" + b"\x00" * 8)
    with pytest.raises(WireError, match="checksum"):
        recv_frame(b)
    a.close(), b.close()


@pytest.mark.parametrize("kernel_deadline", [True, False])
def test_a_frame_arrives_whole_with_or_without_a_kernel_deadline(monkeypatch, kernel_deadline):
    """With the kernel's receive deadline a body arrives in one MSG_WAITALL call; a socket that
    refuses it keeps Python's timeout and reads segment by segment, to the same frame."""
    from kvhive.connector.disagg import wire

    if not kernel_deadline:
        monkeypatch.delattr(socket, "SO_RCVTIMEO", raising=False)
    a, b = socket.socketpair()
    wire.blocking_with_deadline(b, 2.0)
    assert (b.gettimeout() is None) is kernel_deadline
    body = [bytes(range(256)) * 4096, b"tail"]          # 1 MB: more than the socket buffers hold
    sender = threading.Thread(target=send_frame, args=(a, {"type": "layer"}, body))
    sender.start()
    header, got = wire.recv_frame(b)
    sender.join()
    assert header["type"] == "layer" and bytes(got) == b"".join(body)
    a.close()
    with pytest.raises(WireError, match="ended"):
        wire.recv_frame(b)
    b.close()


@pytest.mark.parametrize("raw, field", [
    ({"do_remote_decode": True, "transfer_id": "x", "decode_endpoint": "nohost"}, "decode_endpoint"),
    ({"do_remote_decode": True, "transfer_id": "bad id!", "decode_endpoint": "h:1"}, "transfer_id"),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"do_remote_prefill": True, "transfer_id": "x"}, "do_remote_prefill"),     # not a decode instance
    ({str(i): 1 for i in range(17)}, "kv_transfer_params"),
])
def test_bad_transfer_params_name_the_field(raw, field):
    with pytest.raises(KVTransferParamsError) as err:
        parse_kv_transfer_params(raw, "prefill")
    assert err.value.field == field


@pytest.mark.parametrize("cached", [-1, 1 << 31, 1.5, "8", True, None])
def test_a_bad_prefill_cached_count_names_the_field(cached):
    with pytest.raises(KVTransferParamsError) as err:
        parse_kv_transfer_params({"do_remote_prefill": True, "transfer_id": "x",
                                  "prefill_cached_tokens": cached}, "decode")
    assert err.value.field == "prefill_cached_tokens"


def test_transfer_params_round_trip():
    params = parse_kv_transfer_params({"do_remote_decode": True, "transfer_id": "abc",
                                       "decode_endpoint": "10.0.0.2:7000", "remote_engine_id": "x"}, "prefill")
    decode = parse_kv_transfer_params(params.for_decode(), "decode")
    assert decode.do_remote_prefill and decode.transfer_id == "abc" and decode.prefill_cached_tokens == 0
    told = parse_kv_transfer_params({**params.for_decode(), "prefill_cached_tokens": 32}, "decode")
    assert told.prefill_cached_tokens == 32
    assert parse_kv_transfer_params({"do_remote_decode": False}, "both") is None
