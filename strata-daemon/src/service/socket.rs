//! The daemon's Unix socket: created with mode 0660; a stale socket file of
//! a dead daemon is replaced, a live daemon's is left alone.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

/// Errors from binding the socket.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another process answers on the socket.
    #[error("another daemon is listening on {0} (stop it, or pass a different --socket)")]
    InUse(String),
    /// The path exists and is not a socket.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(String),
    /// OS error.
    #[error("socket {path}: {source}")]
    Io {
        /// Socket path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// Checks that `path` can be taken: absent, or a stale socket. Errors:
/// [`SocketError::InUse`] when a daemon answers there,
/// [`SocketError::NotASocket`] when something else is at the path.
pub fn preflight(path: &Path) -> Result<(), SocketError> {
    let p = path.display().to_string();
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(SocketError::NotASocket(p));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(SocketError::InUse(p));
        }
    }
    Ok(())
}

/// Binds a listener at `path` (creating the parent directory), replacing a
/// stale socket file, and sets its mode to 0660. Errors as [`preflight`], or I/O.
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener, SocketError> {
    let p = path.display().to_string();
    let io = |source| SocketError::Io { path: p.clone(), source };
    preflight(path)?;
    if std::fs::symlink_metadata(path).is_ok() {
        tracing::info!(socket = %p, "replacing stale socket file");
        std::fs::remove_file(path).map_err(io)?;
    }
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(io)?;
    Ok(listener)
}
