//! The GitHub and Gitea clients against the fake forge of
//! tests/support/fake_forge.rs (a real HTTP server speaking both APIs): one
//! plan comment per pull request edited in place, never a human's comment,
//! commit statuses, pagination, rate limits honoured (no call inside a
//! `Retry-After`, by the fake's own clock), and errors that never carry the
//! token.

use crate::support::fake_forge::{
    BOT_LOGIN, Dialect, FakeForge, FakePr, LimitForm, OWNER, REPO, RateLimit, TOKEN,
};
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use vmmigrate::gitops::forge::{CommitState, Forge, GitHub, Gitea};
use vmmigrate::gitops::plan::{PLAN_MARKER, PlanInput, STATUS_CONTEXT, commit_state};

const DIALECTS: [Dialect; 2] = [Dialect::GitHub, Dialect::Gitea];
const SHA: &str = "3f2a9c1b7d4e5f60718293a4b5c6d7e8f9012345";

fn client_with_token(fake: &FakeForge, dialect: Dialect, token: &str) -> Box<dyn Forge> {
    let base = fake.base_url(dialect);
    match dialect {
        Dialect::GitHub => Box::new(GitHub::new(&base, OWNER, REPO, token).expect("GitHub client")),
        Dialect::Gitea => Box::new(Gitea::new(&base, OWNER, REPO, token).expect("Gitea client")),
    }
}

fn client(fake: &FakeForge, dialect: Dialect) -> Box<dyn Forge> {
    client_with_token(fake, dialect, TOKEN)
}

fn plan(text: &str) -> String {
    format!("{PLAN_MARKER}\n### vmmigrate plan\n\n{text}\n")
}

fn count_calls(fake: &FakeForge, method: &str, path_prefix: &str) -> usize {
    fake.calls().iter().filter(|c| c.method == method && c.path.starts_with(path_prefix)).count()
}

#[tokio::test]
async fn upsert_creates_one_comment_and_edits_it_on_the_next_push() {
    captured_logs();
    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        fake.add_pr(FakePr::open(7, SHA).with_files(&["migrations/web/web-01.yaml"]));
        let forge = client(&fake, dialect);

        let first = forge.upsert_comment(7, PLAN_MARKER, &plan("for aaa")).await.expect("first upsert");
        let second = forge.upsert_comment(7, PLAN_MARKER, &plan("for bbb")).await.expect("second upsert");

        let comments = fake.comments(7);
        assert_eq!(comments.len(), 1, "{dialect:?}: {comments:#?}");
        assert_eq!(first, second, "{dialect:?}");
        assert_eq!(comments[0].id, first);
        assert_eq!(comments[0].body, plan("for bbb"));
        assert_eq!(comments[0].author, BOT_LOGIN);

        // An unchanged plan is not written again.
        forge.upsert_comment(7, PLAN_MARKER, &plan("for bbb")).await.expect("third upsert");
        assert_eq!(count_calls(&fake, "PATCH", "/repos/"), 1, "{dialect:?}");
        assert_eq!(count_calls(&fake, "POST", "/repos/"), 1, "{dialect:?}");
        assert_eq!(fake.comments(7)[0].edits, 1);
    }
}

#[tokio::test]
async fn a_human_comment_quoting_the_marker_is_not_edited() {
    captured_logs();
    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        fake.add_pr(FakePr::open(7, SHA));
        let quote = format!("> {PLAN_MARKER}\n> 1 to create\n\nWhy does web-01 get 8Gi?");
        let human = fake.add_comment(7, "alice", &quote);
        let forge = client(&fake, dialect);

        let ours = forge.upsert_comment(7, PLAN_MARKER, &plan("first")).await.expect("upsert");
        assert_ne!(ours, human, "{dialect:?}");
        let again = forge.upsert_comment(7, PLAN_MARKER, &plan("second")).await.expect("upsert again");
        assert_eq!(again, ours, "{dialect:?}");

        let comments = fake.comments(7);
        assert_eq!(comments.len(), 2, "{dialect:?}: {comments:#?}");
        let alice = comments.iter().find(|c| c.id == human).unwrap();
        assert_eq!((alice.body.as_str(), alice.edits), (quote.as_str(), 0), "{dialect:?}");
        assert_eq!(alice.refused_edits, 0, "{dialect:?}: the client tried to edit a human's comment");
        let bot = comments.iter().find(|c| c.id == ours).unwrap();
        assert_eq!((bot.author.as_str(), bot.body.clone()), (BOT_LOGIN, plan("second")));
        // The login is asked once per client.
        assert_eq!(count_calls(&fake, "GET", "/user"), 1, "{dialect:?}");
    }
}

#[tokio::test]
async fn commit_status_is_set_with_the_plan_context() {
    captured_logs();
    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        let forge = client(&fake, dialect);
        let input = PlanInput {
            head_sha: SHA.into(),
            errors: vec![format!(
                "migrations/web/web-01.yaml:14: spec.target.memory: {} is not a quantity",
                "9".repeat(150)
            )],
            ..PlanInput::default()
        };
        let (state, description) = commit_state(&input);
        assert_eq!(state, CommitState::Failure);
        let url = "https://vmmigrate.example/plans/7";

        forge
            .set_commit_status(SHA, STATUS_CONTEXT, CommitState::Pending, "Planning…", None)
            .await
            .expect("pending");
        forge.set_commit_status(SHA, STATUS_CONTEXT, state, &description, Some(url)).await.expect("failure");

        let statuses = fake.statuses(SHA);
        assert_eq!(statuses.len(), 2, "{dialect:?}");
        assert!(statuses.iter().all(|s| s.context == "vmmigrate/plan"), "{statuses:#?}");
        assert_eq!((statuses[0].state.as_str(), statuses[0].target_url.as_deref()), ("pending", None));
        let last = &statuses[1];
        assert_eq!(last.state, "failure");
        assert_eq!(last.target_url.as_deref(), Some(url));
        assert!(
            last.description.starts_with("1 error in the manifests; first at migrations/web/web-01.yaml:14")
        );
        assert!(last.description.chars().count() <= 140);
    }
}

#[tokio::test]
async fn every_request_carries_the_dialects_credentials_and_headers() {
    captured_logs();
    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        fake.add_pr(FakePr::open(3, SHA));
        let forge = client(&fake, dialect);
        forge.pull_request(3).await.expect("pull request");
        forge.upsert_comment(3, PLAN_MARKER, &plan("x")).await.expect("upsert");
        forge.set_commit_status(SHA, STATUS_CONTEXT, CommitState::Success, "ok", None).await.expect("status");

        let calls = fake.calls();
        assert!(calls.len() >= 4, "{calls:#?}");
        for call in calls {
            assert_eq!(call.dialect, dialect);
            assert!(call.has_auth && call.authorized, "{call:#?}");
            assert_eq!(call.headers.get("user-agent").map(String::as_str), Some("vmmigrate"), "{call:#?}");
            if dialect == Dialect::GitHub {
                assert_eq!(
                    call.headers.get("accept").map(String::as_str),
                    Some("application/vnd.github+json")
                );
                assert_eq!(call.headers.get("x-github-api-version").map(String::as_str), Some("2022-11-28"));
            }
        }
    }
}

#[tokio::test]
async fn pagination_finds_a_marker_comment_beyond_the_first_page() {
    captured_logs();
    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        fake.add_pr(FakePr::open(9, SHA));
        // 120 comments: two GitHub pages of 100, three Gitea pages of 50; ours is the 111th.
        for i in 0..110 {
            fake.add_comment(9, "alice", &format!("comment {i}"));
        }
        let ours = fake.add_comment(9, BOT_LOGIN, &plan("old"));
        for i in 0..9 {
            fake.add_comment(9, "bob", &format!("late comment {i}"));
        }
        let forge = client(&fake, dialect);

        let id = forge.upsert_comment(9, PLAN_MARKER, &plan("new")).await.expect("upsert");

        assert_eq!(id, ours, "{dialect:?}");
        let comments = fake.comments(9);
        assert_eq!(comments.len(), 120, "{dialect:?}: no second plan comment");
        assert_eq!(comments.iter().find(|c| c.id == ours).unwrap().body, plan("new"));
        let pages = fake
            .calls()
            .into_iter()
            .filter(|c| {
                c.method == "GET" && c.path.starts_with("/repos/acme/vm-migrations/issues/9/comments")
            })
            .count();
        let expected = match dialect {
            Dialect::GitHub => 2,
            Dialect::Gitea => 3,
        };
        assert_eq!(pages, expected, "{dialect:?}: {:#?}", fake.calls());
    }
}

#[tokio::test]
async fn pull_requests_and_changed_files_are_read_across_pages() {
    captured_logs();
    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        for n in 1..=130 {
            fake.add_pr(FakePr::open(n, &format!("{n:040x}")));
        }
        fake.add_pr(FakePr::open(200, SHA).merged());
        let files: Vec<String> = (0..140).map(|i| format!("migrations/batch/vm-{i:03}.yaml")).collect();
        let file_refs: Vec<&str> = files.iter().map(String::as_str).collect();
        fake.add_pr(FakePr::open(201, SHA).with_files(&file_refs));
        let forge = client(&fake, dialect);

        let open = forge.open_pull_requests().await.expect("open pull requests");
        assert_eq!(open.len(), 131, "{dialect:?}");
        assert!(open.iter().all(|pr| pr.state == "open" && !pr.merged));
        let pr7 = open.iter().find(|pr| pr.number == 7).unwrap();
        assert_eq!(
            (pr7.head_sha.as_str(), pr7.head_ref.as_str(), pr7.base_ref.as_str()),
            (&*format!("{:040x}", 7), "change-7", "main")
        );

        let merged = forge.pull_request(200).await.expect("merged pull request");
        assert!(merged.merged && merged.state == "closed", "{dialect:?}: {merged:?}");

        assert_eq!(forge.changed_files(201).await.expect("changed files"), files, "{dialect:?}");
    }
}

/// Calls `attempt` every 25 ms until it succeeds (at most 30 s); returns the refusals seen.
async fn until_ok<T>(
    mut attempt: impl AsyncFnMut() -> Result<T, vmmigrate::gitops::forge::ForgeError>,
) -> (T, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut refusals = Vec::new();
    loop {
        match attempt().await {
            Ok(v) => return (v, refusals),
            Err(e) => {
                assert_eq!((e.reason(), e.retryable()), ("ForgeRateLimited", true), "{e}");
                refusals.push(e.message);
            }
        }
        assert!(Instant::now() < deadline, "still refused after 30 s: {refusals:#?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn a_rate_limited_forge_gets_no_call_inside_its_retry_after_and_the_status_lands_once() {
    captured_logs();
    let cases = [
        (Dialect::GitHub, LimitForm::RetryAfter),
        (Dialect::GitHub, LimitForm::GitHubReset),
        (Dialect::Gitea, LimitForm::RetryAfter),
    ];
    let runs = cases.map(|(dialect, form)| async move {
        let fake = FakeForge::start().await;
        fake.add_pr(FakePr::open(7, SHA));
        let forge = client(&fake, dialect);
        // Two limited answers in a row, from the status write on: the retry
        // after the first wait meets the second.
        fake.rate_limit(RateLimit {
            from: "POST /repos/acme/vm-migrations/statuses/".into(),
            calls: 2,
            wait: Duration::from_secs(1),
            form,
        });
        let started = Instant::now();
        let ((), refusals) = until_ok(async || {
            forge.set_commit_status(SHA, STATUS_CONTEXT, CommitState::Success, "ok", None).await
        })
        .await;
        let took = started.elapsed();

        let answers = fake.limit_answers();
        let inside = fake.calls_inside_retry_after();
        eprintln!(
            "{dialect:?} {form:?}: {} rate-limited answers, {} calls refused locally, forge calls inside Retry-After {}, status after {:.1} s",
            answers.len(),
            refusals.len().saturating_sub(answers.len()),
            inside.len(),
            took.as_secs_f64()
        );
        assert_eq!(answers.len(), 2, "{dialect:?} {form:?}");
        assert!(inside.is_empty(), "{dialect:?} {form:?}: calls inside Retry-After: {inside:#?}");
        assert_eq!(fake.statuses(SHA).len(), 1, "{dialect:?} {form:?}: the status lands once");
        assert!(took >= Duration::from_secs(2), "{dialect:?} {form:?}: two waits of a second, {took:?}");
        assert!(
            refusals.iter().any(|r| r.contains("not sent: the forge's rate limit")),
            "{dialect:?} {form:?}: {refusals:#?}"
        );
        // Once the limit passed, the next call goes out at once.
        forge.pull_request(7).await.expect("after the limit");
    });
    futures::future::join_all(runs).await;
}

/// Collects everything `tracing` writes while a test runs.
#[derive(Clone, Default)]
struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLogs {
    type Writer = CapturedLogs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// The process-wide subscriber, installed by the first test that runs. A
/// global one rather than a scoped one per test: tracing caches "nobody
/// listens" per callsite across threads, so a scoped subscriber misses events
/// whenever a parallel test touched the callsite first.
fn captured_logs() -> &'static CapturedLogs {
    static LOGS: OnceLock<CapturedLogs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = CapturedLogs::default();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(logs.clone())
            .init();
        logs
    })
}

#[tokio::test]
async fn errors_name_the_status_and_never_the_token() {
    let logs = captured_logs();
    let wrong = "wrong-token-0d9f8e7c6b5a";

    for dialect in DIALECTS {
        let fake = FakeForge::start().await;
        fake.add_pr(FakePr::open(7, SHA));

        // The fake echoes the offered credential in its 401 body.
        let forge = client_with_token(&fake, dialect, wrong);
        let err = forge.open_pull_requests().await.expect_err("a wrong token is refused");
        assert_eq!(err.status, Some(401), "{dialect:?}: {err}");
        assert!(err.message.contains("HTTP 401") && err.message.contains("Bad credentials"), "{err}");
        assert!(!err.message.contains(wrong), "{dialect:?}: {err}");
        assert!(err.message.contains("[redacted]"), "the echo was scrubbed, not lost: {err}");
        assert_eq!(err.reason(), "ForgeUnauthorized");

        let forge = client(&fake, dialect);
        let err = forge.pull_request(404_404).await.expect_err("no such pull request");
        assert_eq!(err.status, Some(404), "{dialect:?}: {err}");
        assert!(err.message.contains("GET /repos/acme/vm-migrations/pulls/404404: HTTP 404"), "{err}");
        assert!(!err.message.contains(TOKEN));
    }

    // No answer at all: a port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let forge = GitHub::new(&format!("http://127.0.0.1:{port}"), OWNER, REPO, wrong).unwrap();
    let err = forge.open_pull_requests().await.expect_err("connection refused");
    assert_eq!(err.status, None, "{err}");
    assert!(err.retryable());
    assert!(!err.message.contains(wrong), "{err}");
    assert!(
        err.message.starts_with("GET /repos/acme/vm-migrations/pulls?state=open&per_page=100: "),
        "{err}"
    );
    let gitea = Gitea::new(&format!("http://127.0.0.1:{port}/api/v1"), OWNER, REPO, wrong).unwrap();
    for debug in [format!("{forge:?}"), format!("{gitea:?}")] {
        assert!(!debug.contains(wrong), "{debug}");
    }

    // The buffer is shared by every test of this file: this covers what the others logged so far too.
    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("forge call"), "the calls were logged:\n{logs}");
    for token in [wrong, TOKEN] {
        assert!(!logs.contains(token), "token in the logs:\n{logs}");
    }
}
