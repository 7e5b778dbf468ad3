//! Loader and tokenizer tests, on the CPU: the real SmolLM2-135M GGUF (fetched by
//! `./scripts/setup.sh`), small GGUF files and safetensors directories written here, and
//! hand-built quantization blocks.
//!
//! The tests are declared here, so that their names stay `loader::…`; their bodies are in the
//! submodules, one per topic.

mod dequant;
mod real_model;
mod tiny;
mod tiny_loads;

// The real model and its tokenizer
#[test]
fn smollm2_config_matches_preset() {
    real_model::smollm2_config_matches_preset();
}

#[test]
fn smollm2_has_every_tensor_with_hf_shapes() {
    real_model::smollm2_has_every_tensor_with_hf_shapes();
}

#[test]
fn smollm2_values_match_gguf_py_reference() {
    real_model::smollm2_values_match_gguf_py_reference();
}

#[test]
fn smollm2_qk_unpermuted_and_plausible() {
    real_model::smollm2_qk_unpermuted_and_plausible();
}

#[test]
fn smollm2_tokenizer_round_trips() {
    real_model::smollm2_tokenizer_round_trips();
}

#[test]
fn smollm2_known_encodings() {
    real_model::smollm2_known_encodings();
}

#[test]
fn smollm2_special_tokens_and_chat() {
    real_model::smollm2_special_tokens_and_chat();
}

// Dequantization of hand-built blocks
#[test]
fn dequant_q8_0() {
    dequant::dequant_q8_0();
}

#[test]
fn dequant_q4_0() {
    dequant::dequant_q4_0();
}

#[test]
fn dequant_q4_1() {
    dequant::dequant_q4_1();
}

#[test]
fn dequant_q5_0_and_q5_1() {
    dequant::dequant_q5_0_and_q5_1();
}

#[test]
fn dequant_float_types() {
    dequant::dequant_float_types();
}

#[test]
fn dequant_rejects_unsupported_and_short_data() {
    dequant::dequant_rejects_unsupported_and_short_data();
}

#[test]
fn unpermute_small() {
    dequant::unpermute_small();
}

// A tiny random Llama, written as GGUF and as a safetensors directory
#[test]
fn tiny_gguf_loads_exactly() {
    tiny_loads::tiny_gguf_loads_exactly();
}

#[test]
fn tiny_gguf_wrong_shape_is_shape_mismatch() {
    tiny_loads::tiny_gguf_wrong_shape_is_shape_mismatch();
}

#[test]
fn validate_reports_missing_and_misshapen_tensors() {
    tiny_loads::validate_reports_missing_and_misshapen_tensors();
}

#[test]
fn unsupported_quant_is_reported_with_tensor_and_type() {
    tiny_loads::unsupported_quant_is_reported_with_tensor_and_type();
}

#[test]
fn missing_paths_are_not_found() {
    tiny_loads::missing_paths_are_not_found();
}

#[test]
fn malformed_files_are_format_errors() {
    tiny_loads::malformed_files_are_format_errors();
}

#[test]
fn tiny_safetensors_dir_loads_exactly() {
    tiny_loads::tiny_safetensors_dir_loads_exactly();
}

#[test]
fn tokenizer_from_gguf_vocab_directly() {
    tiny_loads::tokenizer_from_gguf_vocab_directly();
}

#[test]
fn tiny_gguf_llama3_rope_scaling() {
    tiny_loads::tiny_gguf_llama3_rope_scaling();
}
