//! The request and answer bodies shared by `benches/body.rs` and `examples/body_loop.rs`.

/// A chat body of about `bytes`: a system prompt and one user turn.
pub fn chat(bytes: usize) -> Vec<u8> {
    let mut text = String::new();
    while text.len() < bytes {
        text.push_str("the quick brown fox jumps over the lazy dog. \"quoted\" ");
    }
    text.truncate(bytes.saturating_sub(160));
    serde_json::json!({
        "model": "demo-llm",
        "max_tokens": 64,
        "stream": false,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ],
    })
    .to_string()
    .into_bytes()
}

/// A vLLM prefill answer for a prompt of `bytes`: one KV block id per 16 tokens of 4 bytes
/// (512 ids at 32 KB), as pd-sim sends.
pub fn prefill_answer(bytes: usize) -> Vec<u8> {
    let ids: Vec<usize> = (0..bytes.div_ceil(64)).map(|i| 1000 + i).collect();
    serde_json::json!({
        "id": "cmpl-1", "object": "chat.completion", "created": 1, "model": "demo-llm",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
            "finish_reason": "length"}],
        "usage": {"prompt_tokens": bytes / 4, "completion_tokens": 1, "total_tokens": bytes / 4 + 1},
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "engine-1", "remote_block_ids": ids,
            "remote_host": "10.0.0.1", "remote_port": 5600},
    })
    .to_string()
    .into_bytes()
}

/// A TRT-LLM context answer for a prompt of `tokens` tokens (its ids ride along).
pub fn trt_context_answer(tokens: usize) -> Vec<u8> {
    let ids: Vec<u32> = (0..tokens as u32).map(|i| 1000 + i * 7 % 30_000).collect();
    serde_json::json!({
        "id": "cmpl-1", "object": "chat.completion", "model": "demo-llm",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
            "finish_reason": "length",
            "disaggregated_params": {"request_type": "context_only", "first_gen_tokens": [12366],
                "ctx_request_id": 4_611_686_018_427_387_903u64, "encoded_opaque_state": "AAAA",
                "disagg_request_id": 4_611_686_018_427_387_905u64}}],
        "prompt_token_ids": ids,
    })
    .to_string()
    .into_bytes()
}
