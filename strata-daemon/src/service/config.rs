//! The daemon's config file (`--config FILE`): a TOML table whose keys are the long names of the command-line
//! flags (`expert-cache = "auto"`, `ctx = 8192`; `expert_cache` is read the same), turned into the command-line
//! arguments it stands for. A flag given on the command line or through its environment variable wins over the
//! file.
//!
//! Values: a string, integer or float becomes the flag's value; `true`/`false` switches a flag that takes no value
//! on or leaves it off (a flag with a value reads a boolean as the text `true`/`false`); an array is the flag's
//! comma-separated list (`split-device = [0, 1]`). Tables and dates are refused.
//!
//! TOML: the format of <https://toml.io/en/v1.0.0>, read with the `toml` crate.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};

/// Errors reading a config file; each prints as one line naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML (line and column are 1-based).
    #[error("config file {path}:{line}:{col}: {msg}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Line of the error.
        line: usize,
        /// Column of the error.
        col: usize,
        /// What the parser said.
        msg: String,
    },
    /// A key that names no flag (or a flag the file may not set: `config`, `help`, `version`).
    #[error("config file {path}: unknown key {key:?} (keys are the daemon's flag names, e.g. expert-cache)")]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The key as written.
        key: String,
    },
    /// Two keys name the same flag (`expert-cache` and `expert_cache`).
    #[error("config file {path}: keys {a:?} and {b:?} name the same flag")]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// The first key.
        a: String,
        /// The second key.
        b: String,
    },
    /// A value the flag does not take.
    #[error("config file {path}: {key}: {msg}")]
    Value {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// Why the value was refused (the flag's own check).
        msg: String,
    },
}

/// What a config file contributed: the arguments to parse before the command line's, and the keys that the
/// command line (or the environment) overrode.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FileArgs {
    /// Arguments such as `--expert-cache=auto`, in the file's key order.
    pub args: Vec<OsString>,
    /// Keys of the file that a flag on the command line or its environment variable overrode.
    pub overridden: Vec<String>,
}

/// Reads the config file `path` for the command `cmd`, whose command line alone parsed to `given` (to learn which
/// flags the command line or the environment already set). Errors: [`ConfigError`].
pub fn read(path: &Path, cmd: &Command, given: &ArgMatches) -> Result<FileArgs, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    from_str(&text, path, cmd, given)
}

/// [`read`] on the file's text (`path` names it in errors).
pub fn from_str(text: &str, path: &Path, cmd: &Command, given: &ArgMatches) -> Result<FileArgs, ConfigError> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let (line, col) = e.span().map_or((1, 1), |s| line_col(text, s.start));
        ConfigError::Parse { path: path.into(), line, col, msg: e.message().trim().replace('\n', " ") }
    })?;
    let mut out = FileArgs::default();
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let unknown = || ConfigError::UnknownKey { path: path.into(), key: key.clone() };
        if matches!(long.as_str(), "config" | "help" | "version") {
            return Err(unknown());
        }
        let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long.as_str())).ok_or_else(unknown)?;
        let id = arg.get_id().as_str();
        if let Some((a, _)) = seen.iter().find(|(_, i)| *i == id) {
            return Err(ConfigError::Duplicate { path: path.into(), a: (*a).to_string(), b: key.clone() });
        }
        seen.push((key, id));
        // the command line (or the environment) wins: over the same flag, and over a flag it conflicts with
        // (`--resident-experts` given, `mmap-experts = true` in the file)
        let set =
            |id: &str| matches!(given.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
        if set(id) || cmd.get_arg_conflicts_with(arg).iter().any(|c| set(c.get_id().as_str())) {
            out.overridden.push(key.clone());
            continue;
        }
        let bad = |msg: String| ConfigError::Value { path: path.into(), key: key.clone(), msg };
        let switch = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
        let token = match (value, switch) {
            (toml::Value::Boolean(on), true) => {
                if *on == matches!(arg.get_action(), ArgAction::SetTrue) {
                    Some(format!("--{long}"))
                } else {
                    None
                }
            }
            (_, true) => return Err(bad("expected true or false".into())),
            (toml::Value::Array(items), false) => {
                if arg.get_value_delimiter().is_none() {
                    return Err(bad("takes one value, not a list".into()));
                }
                let d = arg.get_value_delimiter().unwrap_or(',');
                let parts = items.iter().map(scalar).collect::<Option<Vec<_>>>();
                let parts = parts.ok_or_else(|| bad("a list of strings or numbers expected".into()))?;
                Some(format!("--{long}={}", parts.join(&d.to_string())))
            }
            (v, false) => Some(format!("--{long}={}", scalar(v).ok_or_else(|| bad("a table or date".into()))?)),
        };
        let Some(token) = token else { continue };
        // the flag's own parser checks the value now, so that an error names the file and key
        if let Err(e) = cmd.clone().try_get_matches_from([cmd.get_name(), token.as_str()]) {
            return Err(bad(first_line(&e.to_string())));
        }
        out.args.push(token.into());
    }
    Ok(out)
}

/// A scalar's text as a flag value (`None` for tables, dates and nested lists).
fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The first line of a clap error, without its `error: ` prefix.
fn first_line(s: &str) -> String {
    let l = s.lines().next().unwrap_or("").trim();
    l.strip_prefix("error: ").unwrap_or(l).to_string()
}

/// 1-based line and column of byte `at` in `text`.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    fn cmd() -> Command {
        Command::new("d")
            .arg(Arg::new("config").long("config"))
            .arg(Arg::new("ctx").long("ctx").value_parser(clap::value_parser!(usize)).default_value("4096"))
            .arg(Arg::new("expert_cache").long("expert-cache"))
            .arg(Arg::new("mmap_experts").long("mmap-experts").action(ArgAction::SetTrue))
            .arg(Arg::new("split_device").long("split-device").value_delimiter(',').action(ArgAction::Append))
            .arg(Arg::new("api_key").long("api-key").env("STRATA_TEST_CONFIG_KEY"))
    }

    fn run(text: &str, cli: &[&str]) -> Result<(FileArgs, ArgMatches), ConfigError> {
        let c = cmd();
        let given = c.clone().try_get_matches_from(std::iter::once("d").chain(cli.iter().copied())).unwrap();
        let f = from_str(text, Path::new("s.toml"), &c, &given)?;
        let mut argv: Vec<OsString> = vec!["d".into()];
        argv.extend(f.args.iter().cloned());
        argv.extend(cli.iter().map(OsString::from));
        let m = c.try_get_matches_from(argv).unwrap();
        Ok((f, m))
    }

    #[test]
    fn keys_become_flags_and_the_command_line_wins() {
        let text = "ctx = 8192\nexpert_cache = \"12\"\nmmap-experts = true\nsplit-device = [0, 1]\n";
        let (f, m) = run(text, &[]).unwrap();
        assert_eq!(m.get_one::<usize>("ctx"), Some(&8192));
        assert_eq!(m.get_one::<String>("expert_cache").map(String::as_str), Some("12"));
        assert!(m.get_flag("mmap_experts"));
        let devs: Vec<&String> = m.get_many::<String>("split_device").unwrap().collect();
        assert_eq!(devs, ["0", "1"]);
        assert!(f.overridden.is_empty());
        let (f, m) = run(text, &["--ctx", "100", "--split-device", "2"]).unwrap();
        assert_eq!(m.get_one::<usize>("ctx"), Some(&100));
        let devs: Vec<&String> = m.get_many::<String>("split_device").unwrap().collect();
        assert_eq!(devs, ["2"], "the command line's list replaces the file's");
        assert_eq!(f.overridden, ["ctx", "split-device"]);
        // false leaves a switch off
        let (_, m) = run("mmap-experts = false", &[]).unwrap();
        assert!(!m.get_flag("mmap_experts"));
    }

    #[test]
    fn bad_files_give_one_line_errors_naming_file_and_key() {
        let e = |t: &str| run(t, &[]).unwrap_err().to_string();
        let s = e("ctx = 1\nnot-a-flag = 3");
        assert_eq!(
            s,
            "config file s.toml: unknown key \"not-a-flag\" (keys are the daemon's flag names, e.g. expert-cache)"
        );
        assert!(e("config = \"x\"").contains("unknown key \"config\""));
        let s = e("ctx = \"many\"");
        assert!(s.starts_with("config file s.toml: ctx: ") && s.contains("many"), "{s}");
        assert!(!s.contains('\n'));
        assert!(e("mmap-experts = 1").contains("mmap-experts: expected true or false"));
        assert!(e("ctx = [1, 2]").contains("ctx: takes one value"));
        assert!(e("expert-cache = { a = 1 }").contains("expert-cache: a table or date"));
        assert!(e("ctx = 1\nexpert-cache = 2\nexpert_cache = 3").contains("keys \"expert-cache\" and \"expert_cache\""));
        let s = e("ctx = 1\nexpert-cache = \n");
        assert!(s.starts_with("config file s.toml:2:"), "{s}");
        assert!(!s.contains('\n'), "{s}");
    }

    #[test]
    fn a_command_line_flag_wins_over_a_file_key_it_conflicts_with() {
        let c = cmd().mut_arg("mmap_experts", |a| a.conflicts_with("expert_cache"));
        let given = c.clone().try_get_matches_from(["d", "--expert-cache", "4"]).unwrap();
        let f = from_str("mmap-experts = true\nctx = 9\n", Path::new("s.toml"), &c, &given).unwrap();
        assert_eq!(f.overridden, ["mmap-experts"]);
        assert_eq!(f.args, [OsString::from("--ctx=9")]);
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        std::env::set_var("STRATA_TEST_CONFIG_KEY", "from-env");
        let (f, m) = run("api-key = \"from-file\"", &[]).unwrap();
        std::env::remove_var("STRATA_TEST_CONFIG_KEY");
        assert_eq!(m.get_one::<String>("api_key").map(String::as_str), Some("from-env"));
        assert_eq!(f.overridden, ["api-key"]);
    }
}
