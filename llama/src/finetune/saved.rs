//! A training run's checkpoint folder: the model and optimizer records (burnpack) and
//! `state.json` (the configuration, the step log and the model's shape), written by
//! [`super::train`] and read to resume it or to load the trained model.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{DType, Device};
use serde::{Deserialize, Serialize};

use super::{StepLog, TrainConfig, TrainError};
use crate::config::LlamaConfig;
use crate::model::Llama;

/// What a checkpoint directory holds beside the model and optimizer records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RunState {
    config: TrainConfig,
    pub(super) log: Vec<StepLog>,
    /// The model's shape, so [`load_trained`] can rebuild it (absent in older checkpoints).
    #[serde(default)]
    model: Option<LlamaConfig>,
}

/// The model's parameters in a checkpoint folder (burnpack).
pub(super) const MODEL_FILE: &str = "model.bpk";
/// The optimizer state in a checkpoint folder (burnpack).
pub(super) const OPTIMIZER_FILE: &str = "optimizer.bpk";

pub(super) fn ckpt_err(path: &Path, reason: impl ToString) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// The run state of a checkpoint in `dir`, if there is one; it must have been written with
/// `cfg`.
pub(super) fn read_state(dir: &Path, cfg: &TrainConfig) -> Result<Option<RunState>, TrainError> {
    let state_path = dir.join("state.json");
    if !state_path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&state_path).map_err(|e| ckpt_err(&state_path, e))?;
    let state: RunState = serde_json::from_str(&text).map_err(|e| ckpt_err(&state_path, e))?;
    let same = TrainConfig {
        layer_checkpointing: cfg.layer_checkpointing,
        ..state.config.clone()
    };
    if same != *cfg {
        return Err(ckpt_err(
            &state_path,
            "was written with another configuration; resume with the same one",
        ));
    }
    Ok(Some(state))
}

pub(super) fn save_checkpoint(
    dir: &Path,
    model: &Llama,
    optim: &burn::optim::ModuleOptimizer,
    cfg: &TrainConfig,
    log: &[StepLog],
) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|e| ckpt_err(dir, e))?;
    model
        .clone()
        .save_file(dir.join(MODEL_FILE))
        .map_err(|e| ckpt_err(dir, e))?;
    optim
        .save(dir.join(OPTIMIZER_FILE))
        .map_err(|e| ckpt_err(dir, e))?;
    let state = RunState {
        config: cfg.clone(),
        log: log.to_vec(),
        model: Some(model.config.clone()),
    };
    let path = dir.join("state.json");
    let text = serde_json::to_string_pretty(&state).map_err(|e| ckpt_err(&path, e))?;
    std::fs::write(&path, text).map_err(|e| ckpt_err(&path, e))
}

/// Whether `path` is a training checkpoint: a folder with `state.json` and a model record (the
/// `checkpoint/` folder [`train`] writes, or the run folder above it).
pub fn checkpoint_dir(path: &Path) -> Option<PathBuf> {
    [path.to_path_buf(), path.join("checkpoint")]
        .into_iter()
        .find(|d| d.join("state.json").is_file() && d.join(MODEL_FILE).is_file())
}

/// The model a training run saved (see [`checkpoint_dir`]), at `dtype` on `device`.
///
/// # Errors
/// [`TrainError::Checkpoint`] when the folder is not a checkpoint, predates the saved model
/// shape, or its record does not load.
pub fn load_trained(path: &Path, device: &Device, dtype: DType) -> Result<Llama, TrainError> {
    let dir = checkpoint_dir(path)
        .ok_or_else(|| ckpt_err(path, "no state.json and model.bpk here or in checkpoint/"))?;
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| ckpt_err(&state_path, e))?;
    let state: RunState = serde_json::from_str(&text).map_err(|e| ckpt_err(&state_path, e))?;
    let cfg = state.model.ok_or_else(|| {
        ckpt_err(
            &state_path,
            "written before checkpoints kept the model shape",
        )
    })?;
    Llama::random(&cfg, device, dtype)
        .try_load_file(dir.join(MODEL_FILE))
        .map_err(|e| ckpt_err(&dir, e))
}

/// A model from `path`: a training checkpoint (a run folder, see [`load_trained`]) or a model the
/// loader reads (.gguf or HF folder); e.g. a draft for [`crate::spec::speculative_generate`],
/// which checks that its vocabulary matches the target's.
///
/// # Errors
/// The loader's or the checkpoint's error, as text.
pub fn load_model(
    path: &std::path::Path,
    device: &Device,
    dtype: burn::tensor::DType,
) -> Result<Llama, String> {
    if checkpoint_dir(path).is_some() {
        return load_trained(path, device, dtype).map_err(|e| e.to_string());
    }
    let ckpt = crate::loader::load(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Llama::from_checkpoint(&ckpt, device, dtype).map_err(|e| e.to_string())
}
