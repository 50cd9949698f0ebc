//! `agent batch` facing bad inputs: what it refuses before running anything, and what it
//! records as one instance's failure while the others run.

use crate::Bench;

#[tokio::test]
async fn a_truncated_preds_json_stops_the_batch_and_is_left_byte_identical() {
    let bench = Bench::new(2, &[], &[]);
    std::fs::create_dir_all(bench.out()).unwrap();
    let preds = bench.out().join("preds.json");
    let truncated = format!(
        "{{\n  \"{}\": {{\n    \"model_name_or_path\": \"scripted\",\n    \"model_pa",
        bench.id(0)
    );
    std::fs::write(&preds, &truncated).unwrap();
    let run = bench.run(&["-w", "2"]).await;
    assert_ne!(run.code, 0);
    assert!(
        run.stderr.contains("preds.json is not valid JSON"),
        "{}",
        run.stderr
    );
    assert_eq!(std::fs::read_to_string(&preds).unwrap(), truncated);
    assert_eq!((bench.starts(0), bench.starts(1)), (0, 0));
    // --redo-existing does not read past it either.
    let redo = bench.run(&["--redo-existing"]).await;
    assert_ne!(redo.code, 0);
    assert_eq!(std::fs::read_to_string(&preds).unwrap(), truncated);

    // The control: the same batch with preds.json gone runs.
    std::fs::remove_file(&preds).unwrap();
    assert_eq!(bench.run(&["-w", "2"]).await.code, 0);
    assert_eq!(bench.preds().len(), 2);
}

/// Append raw instance lines to a bench's instances file.
fn append(bench: &Bench, lines: &[serde_json::Value]) {
    let file = bench.path().join("instances.jsonl");
    let mut text = std::fs::read_to_string(&file).unwrap();
    for line in lines {
        text.push_str(&format!("{line}\n"));
    }
    std::fs::write(&file, text).unwrap();
}

#[tokio::test]
async fn ids_that_would_write_outside_the_output_are_failures_and_the_others_run() {
    let bench = Bench::new(1, &[], &[]);
    let escape = bench.path().join(format!("escape-{}", bench.tag));
    let absolute = format!("{}/abs", bench.path().display());
    let bad = [
        format!("../escape-{}", bench.tag),
        absolute.clone(),
        format!("sub/{}", bench.tag),
    ];
    append(
        &bench,
        &bad.iter()
            .map(|id| serde_json::json!({"instance_id": id, "problem_statement": "p", "value": 9}))
            .collect::<Vec<_>>(),
    );
    let run = bench.run(&["-w", "2"]).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "Submitted");
    let statuses = bench.statuses();
    for id in &bad {
        assert!(statuses["InvalidInstance"].contains(id), "{statuses:?}");
        assert!(run.stderr.contains(&format!("{id:?}")), "{}", run.stderr);
    }
    // Nothing was written outside -o, nor in a directory of another name inside it; and the
    // refused ids are not in preds.json, so a rerun with a fixed file does them.
    assert!(!escape.exists());
    assert!(!std::path::Path::new(&absolute).exists());
    assert!(!bench.out().join("sub").exists());
    assert_eq!(bench.preds().len(), 1);
}

#[tokio::test]
async fn duplicate_ids_refuse_the_instances_file_before_anything_runs() {
    let bench = Bench::new(2, &[], &[]);
    let id = bench.id(1);
    append(
        &bench,
        &[serde_json::json!({"instance_id": id, "problem_statement": "again", "value": 1})],
    );
    let run = bench.run(&["-w", "2"]).await;
    assert_ne!(run.code, 0);
    assert!(
        run.stderr
            .contains(&format!("more than one instance with the id {id:?}")),
        "{}",
        run.stderr
    );
    assert_eq!((bench.starts(0), bench.starts(1)), (0, 0));
    assert!(bench.preds().is_empty());
}

#[tokio::test]
async fn an_instance_without_a_problem_statement_fails_naming_its_id_and_the_others_run() {
    let bench = Bench::new(1, &[], &[]);
    let id = format!("toy__{}-no-statement", bench.tag);
    append(
        &bench,
        &[serde_json::json!({"instance_id": id, "value": 7})],
    );
    let run = bench.run(&[]).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "Submitted");
    assert_eq!(
        bench.statuses()["InvalidInstance"],
        std::slice::from_ref(&id)
    );
    assert!(
        run.stderr
            .contains(&format!("{id:?} has no problem_statement")),
        "{}",
        run.stderr
    );
    assert!(bench.log().contains("has no problem_statement"));
    // Never started (no executor, no model), and not in preds.json: a rerun does it.
    assert!(!bench.out().join(&id).exists());
    assert_eq!(bench.preds().len(), 1);
}
