"""Hot ops of the sparse decode step. Each is a PyTorch custom op `sparsekv::<op>` (torch.library): its CPU
implementation is the plain-PyTorch reference `<op>_reference`, its CUDA implementation the Triton kernel (behind
the shape conditions the kernel supports), its fake implementation the output's shape for torch.compile. The public
function of each module checks its arguments and calls the op. SPARSEKV_DISABLE_TRITON=1 forces the references.

    bits.pack_sign_bits(x[..., D]) -> int32[..., ceil(D/32)]           bits.popcount32(int32) -> int32
    hamming.hamming_scores(qc[B,Hq,Q,W], kc[B,Hkv,N,W], *, bits) -> int32[B,Hkv,Q,N]   (matching bits, GQA-summed)
    hamming.hamming_topk(qc, kc, k, *, bits, recent_first, sink, local, threshold_hint) -> int64[B,Hkv,Q,k]
        (fused score + sort-free top-k; threshold_hint: each row's last threshold, a speed hint the kernel updates)
    hamming.hamming_topk_fixed(qc, kc, k, written, *, bits, sink, local, with_scores, counts)
        -> (int64[B,Hkv,Q,k], scores)   (fixed-shape steps: slots from the device count `written` on are empty
        and rank below every key; counts: each row's own number of picks, the rest padding)
    topk.select_topk(scores[B,S,Q,N], k, *, value_range=None, counts=None) -> int64[B,S,Q,k]   (set semantics)
    top_p.top_p_threshold(weights[R,K], valid[R,K], p) -> bool[R,K]
    int4_qk.quantize_int4(keys) -> (packed u8, scale, zero);  int4_qk.int4_qk(q, packed, scale, zero, idx) -> fp32
    quest.quest_page_scores(q, page_min, page_max, *, group_reduce="sum") -> fp32[B,Hkv,Q,P]
    lut_score.lut_scores(q, centroids[B,Hkv,d/4,16,4], sign_codes[B,Hkv,N,d/32]) -> fp32[B,Hkv,Q,N]
        (the table quantized per row: exact integer sums x the row's step)
    lut_score.lut_topk_fixed(table, sign_codes, k, written, forced, *, sink, local, counts) -> (int64[B,Hkv,1,k], ranks)
        (fixed-shape steps: scoring, forced keys and the first radix histogram in one pass, then the select)
    select_within.select_within(values[..., C], budgets[...], k) -> (int64[..., k], bool[..., k])
        (each row's own budget of its best values, exact, ties to the lower index, indices compacted)
    sign_hash.sign_hash(x, w1, w2=None, b1=None, wr=None, b2=None) -> int32 codes   (linear or MLP hash + packing)
    sign_hash.sign_hash_pair(q, new_keys, key_out, key_mean, key_scale, query_scale, w1, ...) -> query codes
        (a decode step's queries and new keys in one launch; the keys' codes are written into key_out, at
        device rows key_slots if given)
    sparse_attention.sparse_attention(q, keys, values, indices, valid, scaling, *, tickets=None) -> [B,Hq,Q,d]
        (valid None: all; tickets: int32 zeros per row, the split-K partials merged without a second launch)
    write_slots.write_slots(key_buffer[B,H,C,d], value_buffer, slots[n], keys[B,H,n,d], values) -> None
        (a fixed-shape step's new K/V into the preallocated buffers at device slots, one launch for both)
"""
