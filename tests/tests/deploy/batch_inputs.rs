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
