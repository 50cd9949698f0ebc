//! Batch instances, as `mini-extra swebench` reads them: a local JSON or JSONL file, or a
//! datasets-style directory holding `<split>.jsonl` (or `.json`, or `data/<split>-*.jsonl`);
//! then shuffled (as mini: sorted by id, then Python's `random.shuffle` seeded 42), filtered (a
//! regex matched at the start of the id) and sliced (a Python slice).

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
    /// Its own `network` (the config's shape: `none`, `host`, `{mode: policy, allow: [...]}`),
    /// which wins over `environment.network` and the flags, as its image does.
    pub network: Option<protocol::RequestNetwork>,
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
    let problem_statement = text("problem_statement");
    let network = crate::network::from_value(
        fields.get("network").unwrap_or(&Value::Null),
        &format!("instance {id:?}: network"),
    );
    // mini fails such an instance (a KeyError) while the others run; so do we, saying why.
    let invalid = unsafe_id(&id)
        .or_else(|| {
            problem_statement.is_none().then(|| {
                format!("instance {id:?} has no problem_statement (a string): there is no task to give the agent")
            })
        })
        .or_else(|| network.as_ref().err().cloned());
    Ok(Instance {
        problem_statement: problem_statement.unwrap_or_default(),
        invalid,
        network: network.unwrap_or_default(),
        id,
        image,
        fields,
    })
}

/// Parquet files start (and end) with these bytes.
const PARQUET_MAGIC: &[u8] = b"PAR1";

fn is_parquet(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "parquet")
}

/// What to say when only parquet is there: we read JSON and JSONL (no parquet reader).
fn parquet_error(what: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "{} holds parquet only: agent batch reads instances as JSON or JSONL; export the split \
         first, e.g. python -c \"import datasets; datasets.load_dataset('DATASET', \
         split='test').to_json('test.jsonl')\"",
        what.display()
    )
}

fn parse_file(path: &Path) -> anyhow::Result<Vec<Instance>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the instances file {}", path.display()))?;
    if is_parquet(path) || bytes.starts_with(PARQUET_MAGIC) {
        return Err(parquet_error(path));
    }
    let text = String::from_utf8(bytes)
        .with_context(|| format!("the instances file {} is not UTF-8 text", path.display()))?;
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
        let has_parquet = |dir: &Path| {
            std::fs::read_dir(dir).is_ok_and(|entries| {
                entries
                    .filter_map(Result::ok)
                    .any(|e| is_parquet(&e.path()))
            })
        };
        if has_parquet(subset) || has_parquet(&subset.join("data")) {
            return Err(parquet_error(subset));
        }
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

/// What `--shuffle`, `--filter` and `--slice` leave, in that order, as mini's
/// `filter_instances` (run/benchmarks/swebench.py): shuffled after sorting by id (so the order
/// never depends on the file's), with Python's `random.seed(42)`, filtered, then sliced.
pub fn select(
    mut instances: Vec<Instance>,
    shuffle: bool,
    filter: Option<&str>,
    slice: Option<&str>,
) -> anyhow::Result<Vec<Instance>> {
    if shuffle {
        instances.sort_by(|a, b| a.id.cmp(&b.id));
        python_shuffle(&mut instances, 42);
    }
    if let Some(pattern) = filter {
        // Python's re.match: anchored at the start only.
        let re = regex::Regex::new(&format!("^(?:{pattern})"))
            .with_context(|| format!("--filter {pattern:?} is not a regex"))?;
        instances.retain(|i| re.is_match(&i.id));
    }
    // mini skips an empty spec.
    if let Some(spec) = slice.filter(|s| !s.is_empty()) {
        let picked = slice_indices(spec, instances.len())?;
        let mut all: Vec<Option<Instance>> = instances.into_iter().map(Some).collect();
        instances = picked
            .into_iter()
            .filter_map(|i| all.get_mut(i).and_then(Option::take))
            .collect();
    }
    Ok(instances)
}

/// The indices `list[slice(*values)]` picks from a list of `len`, where mini makes `values` as
/// `[int(x) if x else None for x in spec.split(":")]`: so "5" is `[:5]`, and "a:b", "a:b:step",
/// ":b", "a:" are Python's, negative numbers and steps included.
fn slice_indices(spec: &str, len: usize) -> anyhow::Result<Vec<usize>> {
    let usage = "(as Python's list[START:STOP:STEP]; a single number N is [:N])";
    let parts: Vec<&str> = spec.split(':').collect();
    if parts.len() > 3 {
        bail!("--slice {spec:?} has more than three parts {usage}");
    }
    let values = parts
        .iter()
        .map(|p| {
            let p = p.trim();
            if p.is_empty() {
                return Ok(None);
            }
            p.parse::<i64>()
                .map(Some)
                .with_context(|| format!("--slice {spec:?}: {p:?} is not a number {usage}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // slice(stop) with one value, slice(start, stop[, step]) with more.
    let (start, stop, step) = match values[..] {
        [stop] => (None, stop, None),
        [start, stop] => (start, stop, None),
        [start, stop, step] => (start, stop, step),
        _ => (None, None, None),
    };
    let step = step.unwrap_or(1);
    if step == 0 {
        bail!("--slice {spec:?}: the step cannot be zero");
    }
    // CPython's PySlice_AdjustIndices.
    let n = i64::try_from(len).unwrap_or(i64::MAX);
    let adjust = |v: Option<i64>, default: i64| match v {
        None => default,
        Some(v) if v < 0 => {
            let v = v.saturating_add(n);
            if v >= 0 {
                v
            } else if step < 0 {
                -1
            } else {
                0
            }
        }
        Some(v) if v >= n => {
            if step < 0 {
                n - 1
            } else {
                n
            }
        }
        Some(v) => v,
    };
    let (start, stop) = if step > 0 {
        (adjust(start, 0), adjust(stop, n))
    } else {
        (adjust(start, n - 1), adjust(stop, -1))
    };
    let mut picked = Vec::new();
    let mut i = start;
    while (step > 0 && i < stop) || (step < 0 && i > stop) {
        picked.extend(usize::try_from(i).ok());
        i = i.saturating_add(step);
    }
    Ok(picked)
}

/// Python's `random.seed(seed); random.shuffle(items)` exactly: MT19937 (the `rand_mt` crate,
/// the reference mt19937ar) seeded by `init_by_array` with the seed's 32-bit words (CPython's
/// `random_seed`), and each swap index drawn by `_randbelow` (`getrandbits` of the bound's bit
/// length, redrawn while too large).
/// So `--shuffle --slice :50` picks the same 50 instances as mini's.
fn python_shuffle<T>(items: &mut [T], seed: u32) {
    let mut mt = rand_mt::Mt::new_with_key([seed]);
    for i in (1..items.len()).rev() {
        let n = i as u64 + 1;
        // Fewer than 2^32 items: one 32-bit output is always enough.
        let bits = (64 - n.leading_zeros()).min(32);
        let j = loop {
            // getrandbits(k) for k <= 32: the top k bits of one output.
            let r = u64::from(mt.next_u32() >> (32 - bits));
            if r < n {
                break r;
            }
        };
        items.swap(i, j as usize);
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

    fn sliced(n: usize, spec: &str) -> Vec<usize> {
        select(some(n), false, None, Some(spec))
            .unwrap()
            .iter()
            .map(|i| i.id.trim_start_matches("repo__x-").parse().unwrap())
            .collect()
    }

    #[test]
    fn slices_are_minis_python_slices() {
        // Expected values from Python: list(range(10))[slice(*values)].
        assert_eq!(sliced(10, "5"), [0, 1, 2, 3, 4]);
        assert_eq!(sliced(10, "1:3"), [1, 2]);
        assert_eq!(sliced(10, ":3"), [0, 1, 2]);
        assert_eq!(sliced(10, "8:"), [8, 9]);
        assert_eq!(sliced(10, ":-8"), [0, 1]);
        assert_eq!(sliced(10, "-2:"), [8, 9]);
        assert_eq!(sliced(10, "1:8:3"), [1, 4, 7]);
        assert_eq!(sliced(10, "::4"), [0, 4, 8]);
        assert_eq!(sliced(10, "::-3"), [9, 6, 3, 0]);
        assert_eq!(sliced(10, "7:2:-2"), [7, 5, 3]);
        assert_eq!(sliced(10, "-1"), [0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(sliced(10, "20"), (0..10).collect::<Vec<_>>());
        assert!(sliced(10, "12:").is_empty());
        assert_eq!(sliced(10, ""), (0..10).collect::<Vec<_>>());
        for bad in ["1:2:3:4", "a:2", "1:2:0", "1.5"] {
            assert!(
                select(some(10), false, None, Some(bad)).is_err(),
                "{bad:?} accepted"
            );
        }
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
    fn shuffles_are_pythons_random_shuffle_with_seed_42() {
        // python3 -c "import random; l=list(range(20)); random.seed(42); random.shuffle(l); print(l)"
        let mut l: Vec<u32> = (0..20).collect();
        python_shuffle(&mut l, 42);
        assert_eq!(
            l,
            [19, 5, 14, 4, 9, 13, 15, 18, 6, 12, 17, 10, 1, 11, 2, 16, 7, 8, 0, 3]
        );
        // The same for range(1000): first 15 and last 5.
        let mut l: Vec<u32> = (0..1000).collect();
        python_shuffle(&mut l, 42);
        assert_eq!(
            l[..15],
            [776, 507, 895, 922, 33, 483, 85, 750, 354, 523, 184, 809, 418, 615, 682]
        );
        assert_eq!(l[995..], [281, 759, 25, 114, 654]);
    }

    #[test]
    fn shuffles_sort_by_id_first_so_the_file_order_does_not_matter() {
        let forward = select(some(20), true, None, None).unwrap();
        let mut reversed = some(20);
        reversed.reverse();
        let backward = select(reversed, true, None, None).unwrap();
        assert_eq!(ids(&forward), ids(&backward));
        // mini's order for these ids (its filter_instances under CPython):
        // s = sorted(ids); random.seed(42); random.shuffle(s)
        let mini = [
            9, 13, 4, 12, 17, 3, 5, 8, 14, 2, 7, 18, 1, 19, 10, 6, 15, 16, 0, 11,
        ]
        .map(|i| format!("repo__x-{i}"));
        assert_eq!(ids(&forward), mini);
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
    fn a_missing_problem_statement_makes_its_instance_invalid_naming_it() {
        for fields in [
            json!({"instance_id": "a__b-1"}),
            json!({"instance_id": "a__b-1", "problem_statement": null}),
        ] {
            let i = instance(fields).unwrap();
            let why = i.invalid.unwrap();
            assert!(why.contains("\"a__b-1\" has no problem_statement"), "{why}");
        }
        let ok = instance(json!({"instance_id": "a__b-1", "problem_statement": "fix"})).unwrap();
        assert_eq!((ok.invalid, ok.problem_statement.as_str()), (None, "fix"));
    }

    #[test]
    fn an_instance_carries_its_own_network_and_a_bad_one_makes_it_invalid_naming_it() {
        let i = instance(json!({"instance_id": "a__b-1", "problem_statement": "p",
            "network": {"mode": "policy", "allow": ["pypi.org:443"], "deny": ["evil.pypi.org"]}}))
        .unwrap();
        assert_eq!(i.invalid, None);
        assert_eq!(
            i.network,
            Some(protocol::RequestNetwork::Policy {
                allow: vec!["pypi.org:443".into()],
                deny: vec!["evil.pypi.org".into()],
            })
        );
        let i = instance(json!({"instance_id": "a__b-1", "problem_statement": "p",
            "network": "none"}))
        .unwrap();
        assert_eq!(i.network, Some(protocol::RequestNetwork::None {}));
        // The control: no network field, the batch's.
        let i = instance(json!({"instance_id": "a__b-1", "problem_statement": "p"})).unwrap();
        assert_eq!((i.invalid, i.network), (None, None));
        let i = instance(json!({"instance_id": "a__b-1", "problem_statement": "p",
            "network": {"mode": "policy", "allow": "pypi.org"}}))
        .unwrap();
        let why = i.invalid.unwrap();
        assert!(
            why.starts_with("instance \"a__b-1\": network: allow must be a list"),
            "{why}"
        );
    }

    #[test]
    fn parquet_only_says_json_or_jsonl_is_needed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let file = dir.path().join("data/test-00000-of-00001.parquet");
        std::fs::write(&file, b"PAR1\0\x15PAR1").unwrap();
        for (subset, split) in [(dir.path(), "test"), (file.as_path(), "test")] {
            let e = load(subset, split).unwrap_err().to_string();
            assert!(
                e.contains("parquet only") && e.contains("JSON or JSONL"),
                "{e}"
            );
        }
        // The control: a JSONL beside it is read.
        std::fs::write(
            dir.path().join("data/test-00000-of-00001.jsonl"),
            "{\"instance_id\": \"a\", \"problem_statement\": \"p\"}\n",
        )
        .unwrap();
        assert_eq!(load(dir.path(), "test").unwrap().len(), 1);
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
