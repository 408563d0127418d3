//! [`SocketDir`], the relays' sockets as files in a shared directory, against the contract
//! the relays depend on (control/relay_net.rs): a name nobody serves is refused at once, a
//! live name cannot be bound twice, a listener's end frees its name and its file, and a
//! socket file left by a dead server does not block the next one. Real Unix sockets in a
//! scratch directory.

use cohort::control::{RelayNet, SocketDir};
use std::io::ErrorKind;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on each test.
const BOUND: Duration = Duration::from_secs(30);

const NAME: &str = "cohort-heartbeat-relay/0123456789abcdef01234567";

/// A scratch directory, removed with its contents when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cohort-rd-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Self(dir)
    }

    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .expect("read the directory")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn the_relay_contract_holds_on_socket_files() {
    tokio::time::timeout(BOUND, async {
        let scratch = Scratch::new("contract");
        let net = SocketDir::new(&scratch.0).expect("a usable directory");
        let refused = net.connect(NAME).err().expect("nobody serves it yet");
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "{refused}");

        let mut listener = net.bind(NAME).expect("bind");
        let twice = net.bind(NAME).err().expect("a live relay holds the name");
        assert_eq!(twice.kind(), ErrorKind::AddrInUse, "{twice}");
        let socket = "cohort-heartbeat-relay-0123456789abcdef01234567.sock";
        assert_eq!(scratch.files(), [socket.replace(".sock", ".lock"), socket.to_string()]);

        // Bytes flow both ways between a connection and the one the listener hands out.
        let mut client = net.connect(NAME).expect("connect to the live relay");
        let mut served = listener.accept().await;
        client.write_all(b"beat").await.expect("write");
        let mut got = [0u8; 4];
        served.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"beat");
        served.write_all(b"ok").await.expect("answer");
        let mut answer = [0u8; 2];
        client.read_exact(&mut answer).await.expect("read the answer");
        assert_eq!(&answer, b"ok");

        // The listener's end removes its socket and frees the name; the connection it handed
        // out reads end-of-stream once that end is dropped too.
        drop(listener);
        drop(served);
        assert_eq!(client.read(&mut got).await.expect("end of stream"), 0);
        assert_eq!(scratch.files(), [socket.replace(".sock", ".lock")]);
        let after = net.connect(NAME).err().expect("nobody serves it any more");
        assert_eq!(after.kind(), ErrorKind::ConnectionRefused, "{after}");
        net.bind(NAME).expect("the name is free again");
    })
    .await
    .expect("bounded");
}

/// A server that died leaves its socket file (and lets go of its lock): connecting to it is
/// refused as for a name nobody serves, and the next bind takes the name over.
#[tokio::test]
async fn a_dead_servers_socket_file_is_taken_over() {
    tokio::time::timeout(BOUND, async {
        let scratch = Scratch::new("stale");
        let net = SocketDir::new(&scratch.0).expect("a usable directory");
        let file = scratch.0.join("cohort-heartbeat-relay-0123456789abcdef01234567.sock");
        // A listener's socket file outlives it, as a killed process's does.
        drop(std::os::unix::net::UnixListener::bind(&file).expect("a server that then dies"));
        assert!(file.exists());
        let refused = net.connect(NAME).err().expect("a file nobody listens on");
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "{refused}");
        let mut listener = net.bind(NAME).expect("the stale file is replaced");
        let mut client = net.connect(NAME).expect("the new server answers");
        let mut served = listener.accept().await;
        client.write_all(b"x").await.expect("write");
        let mut got = [0u8; 1];
        served.read_exact(&mut got).await.expect("read");
    })
    .await
    .expect("bounded");
}

/// A directory that cannot hold the sockets is refused when the configuration is used, with
/// its reason; one that does not exist fails each bind (the worker then beats on its own).
#[test]
fn an_unusable_directory_is_refused_with_its_reason() {
    let relative = SocketDir::new("relays").expect_err("relative");
    assert_eq!(relative.kind(), ErrorKind::InvalidInput);
    assert!(relative.to_string().contains("not an absolute path"), "{relative}");
    let long = SocketDir::new(format!("/{}", "d".repeat(60))).expect_err("too long");
    assert!(long.to_string().contains("61 bytes long; at most 42"), "{long}");
    SocketDir::new(format!("/{}", "d".repeat(41))).expect("42 bytes fit");

    let missing = SocketDir::new("/nonexistent/cohort-relays").expect("not looked at yet");
    let bound = missing.bind(NAME).err().expect("no directory");
    assert_eq!(bound.kind(), ErrorKind::NotFound, "{bound}");
    let text = bound.to_string();
    assert!(text.starts_with("opening the relay's lock /nonexistent/cohort-relays/cohort-heartbeat-relay-"), "{text}");
    let connected = missing.connect(NAME).err().expect("no directory");
    assert_eq!(connected.kind(), ErrorKind::ConnectionRefused, "{connected}");
}

/// The point of [`SocketDir`]: a process in another network namespace (another pod of the
/// node) reaches the relay through its socket file, where an abstract socket is out of its
/// sight. The other process is `python3` under `unshare --net`; where this machine cannot
/// make a namespace (not root), the test says so and checks nothing.
#[tokio::test]
async fn a_socket_file_reaches_across_network_namespaces() {
    use std::process::{Command, Stdio};
    if !Command::new("unshare").args(["--net", "true"]).status().is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: `unshare --net` fails here (needs root and util-linux)");
        return;
    }
    tokio::time::timeout(BOUND, async {
        let scratch = Scratch::new("netns");
        let net = SocketDir::new(&scratch.0).expect("a usable directory");
        let mut listener = net.bind(NAME).expect("bind");
        let file = scratch.0.join("cohort-heartbeat-relay-0123456789abcdef01234567.sock");
        let client = "import socket, sys\n\
                      s = socket.socket(socket.AF_UNIX)\n\
                      s.connect(sys.argv[1])\n\
                      s.sendall(b'from another namespace')\n\
                      a = socket.socket(socket.AF_UNIX)\n\
                      a.connect(b'\\0' + sys.argv[2].encode())\n";
        let abstract_name = "cohort-test-abstract-relay";
        let _abstract = std::os::unix::net::UnixListener::bind_addr(
            &<std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(abstract_name)
                .expect("name"),
        )
        .expect("an abstract socket in this namespace");
        let child = tokio::process::Command::new("unshare")
            .args(["--net", "--", "python3", "-c", client])
            .arg(&file)
            .arg(abstract_name)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 in a new network namespace");
        let mut served = listener.accept().await;
        let mut got = Vec::new();
        served.read_to_end(&mut got).await.expect("read");
        assert_eq!(got, b"from another namespace");
        let out = child.wait_with_output().await.expect("the child ends");
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The abstract socket of this namespace is not there in the child's.
        assert!(!out.status.success() && stderr.contains("ConnectionRefusedError"), "{stderr}");
    })
    .await
    .expect("bounded");
}
