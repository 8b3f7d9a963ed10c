//! Log lines: the format `VMMIGRATE_LOG_FORMAT` picks and the span fields a
//! JSON line carries. The reconciler's own lines are read in
//! tests/process_wide/logs.rs, which needs the process's global subscriber.

use crate::support::CapturedLogs;
use tracing_subscriber::EnvFilter;
use vmmigrate::api::Phase;
use vmmigrate::cli::{LogFormat, log_subscriber};

#[test]
fn json_log_lines_carry_the_migration_of_the_reconcile_span() {
    let logs = CapturedLogs::default();
    let sink = logs.clone();
    let subscriber = log_subscriber(LogFormat::Json, EnvFilter::new("info"), move || sink.clone());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("reconcile", migration = %"team-a/web-01");
        let _in = span.enter();
        tracing::info!(phase = %Phase::Preparing, "reconciling");
    });
    let lines = logs.json_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["fields"]["message"], "reconciling");
    assert_eq!(lines[0]["fields"]["phase"], "Preparing");
    assert_eq!(lines[0]["span"]["migration"], "team-a/web-01");
    assert_eq!(lines[0]["span"]["name"], "reconcile");
}

#[test]
fn log_format_is_text_unless_json_is_asked_for() {
    assert_eq!(LogFormat::parse(""), Some(LogFormat::Text));
    assert_eq!(LogFormat::parse("text"), Some(LogFormat::Text));
    assert_eq!(LogFormat::parse("JSON"), Some(LogFormat::Json));
    assert_eq!(LogFormat::parse("yaml"), None);
}
