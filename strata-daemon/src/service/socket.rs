//! The daemon's Unix socket: created with mode 0660 in a folder that others cannot rewrite (one writable by
//! everyone without the sticky bit is refused: anyone could replace the socket there); a stale socket file of
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
    /// The socket's folder is writable by everyone without the sticky bit.
    #[error(
        "{0} is writable by every user and has no sticky bit: anyone could replace the socket there (chmod o-w or +t \
         the folder, or pass a --socket elsewhere)"
    )]
    UnsafeFolder(String),
    /// OS error.
    #[error("socket {path}: {source}")]
    Io {
        /// Socket path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// Checks that `path` can be taken: absent, or a stale socket, in a folder that is not writable by everyone
/// without the sticky bit (a folder still to be made is checked at its first existing ancestor). Errors:
/// [`SocketError::InUse`] when a daemon answers there,
/// [`SocketError::NotASocket`] when something else is at the path, [`SocketError::UnsafeFolder`].
pub fn preflight(path: &Path) -> Result<(), SocketError> {
    let p = path.display().to_string();
    let mut dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    while !dir.exists() {
        match dir.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(up) => dir = up,
            None => break,
        }
    }
    if let Ok(meta) = std::fs::metadata(dir) {
        let mode = meta.permissions().mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(SocketError::UnsafeFolder(dir.display().to_string()));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_anyone_can_rewrite_is_refused() {
        let d = std::env::temp_dir().join(format!("strata-sock-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let set = |m: u32| std::fs::set_permissions(&d, std::fs::Permissions::from_mode(m)).unwrap();
        set(0o777);
        let e = preflight(&d.join("s.sock")).unwrap_err();
        assert!(matches!(e, SocketError::UnsafeFolder(_)), "{e}");
        // a folder still to be made is judged by the first one that exists
        assert!(matches!(preflight(&d.join("sub/s.sock")), Err(SocketError::UnsafeFolder(_))));
        set(0o1777); // /tmp's mode: the sticky bit keeps others from replacing our file
        assert!(preflight(&d.join("s.sock")).is_ok());
        set(0o750);
        assert!(preflight(&d.join("s.sock")).is_ok());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
