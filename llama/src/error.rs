//! The loader's and the tokenizer's error, apart from both so neither module imports the other
//! for it.

use std::path::{Path, PathBuf};

/// Why a checkpoint could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: not found", .path.display())]
    NotFound { path: PathBuf },
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not what its name says, or is truncated or corrupted.
    #[error("{}: malformed file: {msg}", .path.display())]
    Format { path: PathBuf, msg: String },
    #[error("tensor `{tensor}`: unsupported data type {quant}")]
    UnsupportedQuant { tensor: String, quant: String },
    #[error("tensor `{tensor}`: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("missing tensor `{name}`")]
    MissingTensor { name: String },
    #[error("missing metadata key `{key}`")]
    MissingMetadata { key: String },
    #[error("tokenizer: {msg}")]
    Tokenizer { msg: String },
}

impl LoadError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            LoadError::NotFound {
                path: path.to_path_buf(),
            }
        } else {
            LoadError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }

    pub(crate) fn format(path: &Path, msg: impl Into<String>) -> Self {
        LoadError::Format {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}
