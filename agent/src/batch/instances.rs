//! Batch instances, as `mini-extra swebench` reads them: a local JSON or JSONL file, or a
//! datasets-style directory holding `<split>.jsonl` (or `.json`, or `data/<split>-*.jsonl`);
//! then shuffled (seeded), filtered (a regex matched at the start of the id) and sliced.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::{Map, Value};

/// One task.
#[derive(Debug, Clone)]
pub struct Instance {
    pub id: String,
    pub problem_statement: String,
    /// `image_name`, else `docker_image`, else SWE-bench's naming.
    pub image: String,
    /// Every field, for `run.env_startup_command` and templates.
    pub fields: Map<String, Value>,
    /// Why this instance cannot run, if it cannot: it is then recorded as a failure
    /// (`InvalidInstance`) while the others run.
    pub invalid: Option<String>,
}

/// Exit status of an instance that cannot run as given (an id that is no file name).
pub const INVALID: &str = "InvalidInstance";

/// Why `id` cannot name an instance's output. mini writes `<out>/<iid>/<iid>.traj.json`: an id
/// like `../x` or `/tmp/x` would put it (and mini's deletion of an old one) outside `-o`, and
/// `a/b` in a directory of another instance. The file name must also fit in NAME_MAX.
fn unsafe_id(id: &str) -> Option<String> {
    const TRAJ: &str = ".traj.json";
    let why = if id.is_empty() {
        "is empty"
    } else if id == "." || id == ".." {
        "is a relative directory"
    } else if id.contains('/') {
        "contains '/'"
    } else if id.contains('\0') {
        "contains a NUL character"
    } else if id.len() + TRAJ.len() > 255 {
        "is too long for a file name"
    } else {
        return None;
    };
    Some(format!(
        "instance id {id:?} {why}: it names the instance's output directory, so it must be a \
         plain file name"
    ))
}

/// SWE-bench's image of an instance without one, as mini names it.
pub fn swebench_image(id: &str) -> String {
    format!(
        "docker.io/swebench/sweb.eval.x86_64.{}:latest",
        id.replace("__", "_1776_")
    )
    .to_lowercase()
}

fn instance(value: Value) -> anyhow::Result<Instance> {
    let Value::Object(fields) = value else {
        bail!("an instance is not a JSON object");
    };
    let text = |key: &str| fields.get(key).and_then(Value::as_str).map(str::to_string);
    let id = text("instance_id").context("an instance has no instance_id")?;
    let image = text("image_name")
        .or_else(|| text("docker_image"))
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| swebench_image(&id));
    Ok(Instance {
        problem_statement: text("problem_statement").unwrap_or_default(),
        invalid: unsafe_id(&id),
        id,
        image,
        fields,
    })
}

fn parse_file(path: &Path) -> anyhow::Result<Vec<Instance>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the instances file {}", path.display()))?;
    let values: Vec<Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a JSON list of instances", path.display()))?
    } else {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(n, line)| {
                serde_json::from_str(line)
                    .with_context(|| format!("{} line {}: not JSON", path.display(), n + 1))
            })
            .collect::<anyhow::Result<_>>()?
    };
    values.into_iter().map(instance).collect()
}

/// The files of `split` in a datasets-style directory. datasets names a `dev` file's split
/// `validation`: either name finds either file.
fn split_files(dir: &Path, split: &str) -> Vec<PathBuf> {
    let names: Vec<&str> = match split {
        "dev" | "validation" => vec!["dev", "validation"],
        other => vec![other],
    };
    let mut found = Vec::new();
    for name in &names {
        for ext in ["jsonl", "json"] {
            let file = dir.join(format!("{name}.{ext}"));
            if file.is_file() {
                found.push(file);
            }
        }
    }
    if found.is_empty() {
        if let Ok(entries) = std::fs::read_dir(dir.join("data")) {
            let mut files: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                    names.iter().any(|s| name.starts_with(&format!("{s}-")))
                        && name.ends_with(".jsonl")
                })
                .collect();
            files.sort();
            found.extend(files);
        }
    }
    found
}

/// Load every instance of `subset` (a file, or a directory and its `split`).
pub fn load(subset: &Path, split: &str) -> anyhow::Result<Vec<Instance>> {
    if subset.is_file() {
        let all = parse_file(subset)?;
        refuse_duplicates(&all, subset)?;
        return Ok(all);
    }
    if !subset.is_dir() {
        bail!(
            "--subset {} is neither an instances file nor a directory (datasets from the hub \
             are not fetched: download them first)",
            subset.display()
        );
    }
    let files = split_files(subset, split);
    if files.is_empty() {
        bail!(
            "no {split}.jsonl, {split}.json or data/{split}-*.jsonl in {}",
            subset.display()
        );
    }
    let mut all = Vec::new();
    for file in files {
        all.extend(parse_file(&file)?);
    }
    refuse_duplicates(&all, subset)?;
    Ok(all)
}

/// Two instances with one id would share one output (mini silently keeps whichever ends last):
/// refuse the file instead of losing one's work.
fn refuse_duplicates(all: &[Instance], subset: &Path) -> anyhow::Result<()> {
    let mut seen = std::collections::HashSet::new();
    let mut twice: Vec<&str> = all
        .iter()
        .filter(|i| !seen.insert(i.id.as_str()))
        .map(|i| i.id.as_str())
        .collect();
    if twice.is_empty() {
        return Ok(());
    }
    twice.sort_unstable();
    twice.dedup();
    bail!(
        "{} has more than one instance with the id {}: ids must be unique (each names its \
         outputs)",
        subset.display(),
        twice
            .iter()
            .map(|id| format!("{id:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// What `--shuffle`, `--filter` and `--slice` leave, in that order (as mini applies them).
pub fn select(
    mut instances: Vec<Instance>,
    shuffle: bool,
    filter: Option<&str>,
    slice: Option<&str>,
) -> anyhow::Result<Vec<Instance>> {
    if shuffle {
        shuffle_seeded(&mut instances, 42);
    }
    if let Some(pattern) = filter {
        // Python's re.match: anchored at the start only.
        let re = regex::Regex::new(&format!("^(?:{pattern})"))
            .with_context(|| format!("--filter {pattern:?} is not a regex"))?;
        instances.retain(|i| re.is_match(&i.id));
    }
    if let Some(spec) = slice {
        let (start, end) = parse_slice(spec, instances.len())?;
        instances = instances
            .into_iter()
            .skip(start)
            .take(end.saturating_sub(start))
            .collect();
    }
    Ok(instances)
}

/// Python's `a:b` on a list of `len`: either side may be empty or negative.
fn parse_slice(spec: &str, len: usize) -> anyhow::Result<(usize, usize)> {
    let Some((a, b)) = spec.split_once(':') else {
        bail!("--slice expects START:END (as Python's a[START:END]), got {spec:?}");
    };
    let bound = |s: &str, default: usize| -> anyhow::Result<usize> {
        if s.trim().is_empty() {
            return Ok(default);
        }
        let n: i64 = s
            .trim()
            .parse()
            .with_context(|| format!("--slice: {s:?} is not a number"))?;
        let len = len as i64;
        Ok((if n < 0 { (len + n).max(0) } else { n.min(len) }) as usize)
    };
    Ok((bound(a, 0)?, bound(b, len)?))
}

/// Fisher-Yates with splitmix64: the same order for the same seed on every machine. (Not
/// Python's `random.shuffle`: the order differs from mini's, the reproducibility does not.)
fn shuffle_seeded<T>(items: &mut [T], seed: u64) {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..items.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ids(list: &[Instance]) -> Vec<&str> {
        list.iter().map(|i| i.id.as_str()).collect()
    }

    fn some(n: usize) -> Vec<Instance> {
        (0..n)
            .map(|i| instance(json!({"instance_id": format!("repo__x-{i}")})).unwrap())
            .collect()
    }

    #[test]
    fn images_come_from_the_instance_else_swebench_naming() {
        let a =
            instance(json!({"instance_id": "Django__django-1", "image_name": "img:1"})).unwrap();
        assert_eq!(a.image, "img:1");
        let b =
            instance(json!({"instance_id": "Django__django-1", "docker_image": "img:2"})).unwrap();
        assert_eq!(b.image, "img:2");
        let c = instance(json!({"instance_id": "Django__django-1"})).unwrap();
        assert_eq!(
            c.image,
            "docker.io/swebench/sweb.eval.x86_64.django_1776_django-1:latest"
        );
    }

    #[test]
    fn slices_are_pythons() {
        assert_eq!(
            ids(&select(some(5), false, None, Some("1:3")).unwrap()),
            ["repo__x-1", "repo__x-2"]
        );
        assert_eq!(
            ids(&select(some(5), false, None, Some(":-3")).unwrap()),
            ["repo__x-0", "repo__x-1"]
        );
        assert_eq!(select(some(5), false, None, Some("4:")).unwrap().len(), 1);
        assert_eq!(select(some(5), false, None, Some("9:")).unwrap().len(), 0);
    }

    #[test]
    fn filters_match_from_the_start_only() {
        let picked = select(some(12), false, Some("repo__x-1"), None).unwrap();
        assert_eq!(ids(&picked), ["repo__x-1", "repo__x-10", "repo__x-11"]);
        assert!(select(some(12), false, Some("x-1"), None)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn shuffles_are_seeded() {
        let a = ids(&select(some(20), true, None, None).unwrap()).join(",");
        let b = ids(&select(some(20), true, None, None).unwrap()).join(",");
        assert_eq!(a, b);
        assert_ne!(a, ids(&some(20)).join(","));
    }

    #[test]
    fn ids_that_are_no_plain_file_name_make_their_instance_invalid() {
        for id in [
            "../x",
            "/tmp/x",
            "a/b",
            "..",
            ".",
            "",
            "a\0b",
            &"x".repeat(250),
        ] {
            let i = instance(json!({"instance_id": id, "problem_statement": "p"})).unwrap();
            assert!(i.invalid.is_some(), "{id:?} accepted");
        }
        for id in [
            "django__django-11099",
            "..x",
            "a.b",
            "a b",
            "x\\y",
            &"x".repeat(245),
        ] {
            let i = instance(json!({"instance_id": id, "problem_statement": "p"})).unwrap();
            assert_eq!(i.invalid, None, "{id:?} refused");
        }
    }

    #[test]
    fn duplicate_ids_refuse_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("i.jsonl");
        std::fs::write(
            &file,
            "{\"instance_id\": \"a\"}\n{\"instance_id\": \"b\"}\n{\"instance_id\": \"a\"}\n",
        )
        .unwrap();
        let e = load(&file, "dev").unwrap_err().to_string();
        assert!(
            e.contains("more than one instance with the id \"a\""),
            "{e}"
        );
        std::fs::write(
            &file,
            "{\"instance_id\": \"a\"}\n{\"instance_id\": \"b\"}\n",
        )
        .unwrap();
        assert_eq!(load(&file, "dev").unwrap().len(), 2);
    }

    #[test]
    fn a_directory_gives_its_split_and_dev_is_validation() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("dev.jsonl"),
            "{\"instance_id\": \"a\"}\n{\"instance_id\": \"b\"}\n",
        )
        .unwrap();
        assert_eq!(load(dir.path(), "validation").unwrap().len(), 2);
        assert_eq!(load(dir.path(), "dev").unwrap().len(), 2);
        assert!(load(dir.path(), "test").is_err());
    }
}
