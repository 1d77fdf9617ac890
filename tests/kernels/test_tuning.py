"""The kernels' tuning data (`pallas_kernels/tuning.py`): every device entry tunes every page
format, and the kernels launch with the tuned device's entries."""

from tangram_jax import kv_layout, kv_quant
from tangram_jax.pallas_kernels import decode_pools, prefill_attention, tuning


def test_every_device_entry_tunes_every_page_format():
    single = set(kv_quant.KV_PRECISIONS)
    for device, entry in tuning.DECODE_TUNINGS.items():
        assert set(entry) == single | set(kv_layout.PRECISION_TIERS), device
        assert set(tuning.DECODE_PROGRAM_SCALES[device]) == single, device
        assert set(tuning.MERGE_TUNINGS[device]) == {"chunk_items", "tile_f32", "num_warps"}
        prefill_attention.PrefillTuning(**tuning.PREFILL_TUNINGS[device])   # validates itself
    assert set(tuning.DECODE_TUNINGS) == set(tuning.DECODE_PROGRAM_SCALES) \
        == set(tuning.MERGE_TUNINGS) == set(tuning.PREFILL_TUNINGS)


def test_the_kernels_read_the_tuned_device_entries():
    device = tuning.TUNED_DEVICE
    assert decode_pools.DECODE_TUNING == tuning.DECODE_TUNINGS[device]
    assert decode_pools.decode_programs("k8v4", 528) \
        == 528 * tuning.DECODE_PROGRAM_SCALES[device]["k8v4"]
    assert decode_pools.decode_programs("k8v4-k4v2", 528) == 528
    assert prefill_attention.PREFILL_TUNING == \
        prefill_attention.PrefillTuning(**tuning.PREFILL_TUNINGS[device])


def test_the_runner_launches_decode_with_its_pool_formats_tuning(monkeypatch):
    """The runner's Pallas decode op passes the tuning of the pool format the engine resolved
    (`AttentionOps.for_backend(pool_format=...)`): the same values the kernel would find from
    the pool's arrays, for every served precision, without reading bit widths back."""
    import jax
    import jax.numpy as jnp

    from tangram_jax.engine.model_runner import AttentionOps
    from tangram_jax.pallas_kernels import decode_attention

    seen = {}
    monkeypatch.setattr(decode_attention, "ragged_paged_decode_attention",
                        lambda *args, **kwargs: seen.update(kwargs))
    for precision in kv_quant.SERVED_PRECISIONS:
        fmt = kv_quant.pool_format(precision)
        k, v = kv_quant.allocate_pools(fmt.page_formats, (4,) * len(fmt.page_formats),
                                       (2, 16, 64), jnp.bfloat16,
                                       make=lambda shape, dtype: jax.ShapeDtypeStruct(shape,
                                                                                      dtype))
        ops = AttentionOps.for_backend(use_kernels=True, pool_format=fmt)
        ops.decode_attention(None, k, v, None, None, None)
        assert (seen["block_tokens"], seen["num_warps"]) == tuning.DECODE_TUNING[precision] \
            == decode_pools.decode_tuning(k, v), precision
