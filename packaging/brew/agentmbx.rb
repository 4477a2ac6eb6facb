# Homebrew formula for agentmbx: builds from source with cargo, installs the shell completions
# (written by the binary itself) and the committed man pages, and runs the host daemon as a
# service (`brew services start agentmbx`: a launchd agent on macOS, a systemd user unit of
# Type=simple on Linux, restarted when it fails on both; the daemon runs fine without a notify
# socket).
class Agentmbx < Formula
  desc "Signed, end-to-end-sealed mailbox for AI agents (daemon, CLI and relay)"
  homepage "https://example.invalid/agentmbx"
  url "https://example.invalid/agentmbx/archive/refs/tags/v0.1.0.tar.gz"
  # Fill in with `shasum -a 256` of the release tarball.
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"
  license any_of: ["MIT", "Apache-2.0"]
  head "https://example.invalid/agentmbx.git", branch: "main"

  depends_on "rust" => :build

  def install
    system "cargo", "install", *std_cargo_args(path: "daemon")
    generate_completions_from_executable(bin/"agentmbx", "completions")
    man1.install Dir["man/*.1"]
  end

  service do
    run [opt_bin/"agentmbx", "daemon"]
    # `keep_alive true`, not `successful_exit: false`: Homebrew turns the latter into no
    # Restart= line at all in the Linux unit. This gives KeepAlive on macOS and
    # Restart=on-failure on Linux; `brew services stop` still stops it on both.
    keep_alive true
    environment_variables PATH: std_service_path_env
    log_path var/"log/agentmbx.log"
    error_log_path var/"log/agentmbx.log"
  end

  test do
    ENV["MBX_HOME"] = testpath/"home"
    ENV["MBX_KEYSTORE"] = "file"
    # Not "#{version}": a --HEAD build reports the crate version, not HEAD-<sha>.
    assert_match(/\Aagentmbx \d+\.\d+\.\d+/, shell_output("#{bin}/agentmbx --version"))
    system bin/"agentmbx", "init", "--host", "brewtest"
    whoami = JSON.parse(shell_output("#{bin}/agentmbx whoami --json"))
    assert_equal "brewtest", whoami["host"]
    assert_equal "file", whoami["keystore"]
    assert_match(/\A\h{4}-\h{4}-\h{4}-\h{4}\z/, whoami["fingerprint"])
    # An initialized home is never overwritten: a second init fails and keeps the key.
    shell_output("#{bin}/agentmbx init --host other 2>&1", 1)
    assert_equal whoami["fingerprint"],
                 JSON.parse(shell_output("#{bin}/agentmbx whoami --json"))["fingerprint"]
    assert_match "complete", shell_output("#{bin}/agentmbx completions bash")
    # doctor reads the same home: identity and key store checks pass (the other checks need a
    # running daemon, peers and a relay).
    doctor = JSON.parse(shell_output("#{bin}/agentmbx doctor --json host-identity keystore"))
    assert_equal [%w[host-identity ok], %w[keystore ok]],
                 doctor["checks"].map { |check| check.values_at("id", "status") }
  end
end
