# Checks packaging/brew/agentmbx.rb without Homebrew: loads the formula against a minimal
# stand-in for the part of Homebrew's Formula DSL it uses, then runs its `install`, `service`
# and `test do` blocks. Run by packaging/check:
#
#   ruby packaging/brew/check.rb <formula.rb> <agentmbx binary>
#
# The stand-in defines only the methods below, with the argument shapes Homebrew accepts
# (keep_alive keys, sha256 format, depends_on tags, ...), and no method_missing: a misspelt or
# unknown DSL call fails with NoMethodError. `install` runs in the repository root (the
# unpacked source tree in a real build) against a temporary prefix; its `cargo install` is
# recorded and checked, not run (the binary given on the command line, already built, is
# copied into the prefix instead); completions and man pages are really generated and
# installed. `test do` then runs for real against that prefix, in a temporary testpath that is
# also HOME, as `brew test` does. Not checked here: what only a real Homebrew knows (download,
# checksum, bottle, audit style rules).
require "fileutils"
require "json"
require "open3"
require "pathname"
require "tmpdir"

# Raised by the stand-in's assertions and checks.
class CheckFailure < StandardError; end

def check(cond, message)
  raise CheckFailure, message unless cond
end

# The `service do` block's DSL: the methods of Homebrew::Service that take arguments.
class StubService
  KEEP_ALIVE_KEYS = [:always, :successful_exit, :crashed, :path].freeze
  PATH_METHODS = [:log_path, :error_log_path, :working_dir, :root_dir, :input_path].freeze

  attr_reader :run_args, :keep_alive_value, :paths, :env

  def initialize(formula, &block)
    @formula = formula
    @paths = {}
    @env = {}
    instance_eval(&block)
  end

  def run(command = nil, macos: nil, linux: nil)
    command ||= linux || macos
    check(command.is_a?(Array) || command.is_a?(String) || command.is_a?(Pathname),
          "service run: expects a command array or path, got #{command.inspect}")
    @run_args = Array(command).map(&:to_s)
  end

  def keep_alive(value)
    case value
    when true, false then nil
    when Hash
      extra = value.keys - KEEP_ALIVE_KEYS
      check(extra.empty?, "service keep_alive: unknown keys #{extra.inspect} (allowed: #{KEEP_ALIVE_KEYS})")
    else check(false, "service keep_alive: expects true/false or a hash, got #{value.inspect}")
    end
    @keep_alive_value = value
  end

  PATH_METHODS.each do |name|
    define_method(name) do |path|
      check(path.is_a?(String) || path.is_a?(Pathname), "service #{name}: expects a path")
      @paths[name] = path.to_s
    end
  end

  def environment_variables(variables)
    check(variables.is_a?(Hash) && variables.keys.all?(Symbol), "service environment_variables: expects a Symbol-keyed hash")
    @env = variables.transform_values(&:to_s)
  end

  def restart_delay(seconds)
    check(seconds.is_a?(Integer), "service restart_delay: expects seconds (Integer)")
  end

  def process_type(value)
    check([:background, :standard, :interactive, :adaptive].include?(value), "service process_type: #{value.inspect}")
  end

  def std_service_path_env
    "/opt/homebrew/bin:/opt/homebrew/sbin:/usr/bin:/bin:/usr/sbin:/sbin"
  end

  [:bin, :opt_bin, :var, :etc].each do |name|
    define_method(name) { @formula.send(name) }
  end
end

# Homebrew's Formula, reduced to the class-level DSL and the instance helpers formulae use in
# `install` and `test do`.
class Formula
  DEPENDENCY_TAGS = [:build, :test, :optional, :recommended].freeze
  LICENSE_KEYS = [:any_of, :all_of].freeze

  class << self
    attr_reader :spec, :service_block, :test_block, :subclasses_seen

    def inherited(subclass)
      super
      (Formula.instance_variable_get(:@subclasses_seen) || Formula.instance_variable_set(:@subclasses_seen, [])) << subclass
      subclass.instance_variable_set(:@spec, { depends_on: [] })
    end

    def desc(text)
      check(text.is_a?(String) && !text.empty? && !text.end_with?(".") && text.length <= 80,
            "desc: a non-empty String of at most 80 characters without a final period")
      @spec[:desc] = text
    end

    def homepage(url)
      check(url.is_a?(String) && url.start_with?("https://"), "homepage: an https URL")
      @spec[:homepage] = url
    end

    def url(url, **options)
      check(url.is_a?(String) && url.start_with?("https://"), "url: an https URL")
      unknown = options.keys - [:tag, :revision, :branch, :using]
      check(unknown.empty?, "url: unknown options #{unknown.inspect}")
      @spec[:url] = url
    end

    def sha256(digest)
      check(digest.is_a?(String) && digest.match?(/\A\h{64}\z/), "sha256: 64 hex digits")
      @spec[:sha256] = digest
    end

    def license(spec)
      case spec
      when String then nil
      when Hash
        check(spec.keys.all? { |k| LICENSE_KEYS.include?(k) } && spec.values.all?(Array),
              "license: a String or {any_of:|all_of: [...]}")
      else check(false, "license: a String or {any_of:|all_of: [...]}")
      end
      @spec[:license] = spec
    end

    def head(url, branch: nil)
      check(url.is_a?(String) && url.start_with?("https://"), "head: an https URL")
      check(branch.nil? || branch.is_a?(String), "head: branch is a String")
      @spec[:head] = url
    end

    def depends_on(dep)
      case dep
      when String then nil
      when Hash
        dep.each do |name, tags|
          check(name.is_a?(String), "depends_on: a formula name")
          check(Array(tags).all? { |t| DEPENDENCY_TAGS.include?(t) }, "depends_on #{name}: unknown tag #{tags.inspect}")
        end
      else check(false, "depends_on: a String or {name => tag}")
      end
      @spec[:depends_on] << dep
    end

    def service(&block)
      @service_block = block
    end

    def test(&block)
      @test_block = block
    end
  end

  attr_reader :prefix, :testpath, :calls

  def initialize(prefix, testpath)
    @prefix = Pathname(prefix)
    @testpath = Pathname(testpath)
    @calls = []
  end

  def bin = prefix/"bin"
  def opt_bin = bin
  def man1 = prefix/"share/man/man1"
  def bash_completion = prefix/"etc/bash_completion.d"
  def zsh_completion = prefix/"share/zsh/site-functions"
  def fish_completion = prefix/"share/fish/vendor_completions.d"
  def var = prefix/"var"
  def etc = prefix/"etc"
  def version = self.class.spec[:url][/v?(\d+\.\d+\.\d+)/, 1]

  # Homebrew's std_cargo_args: the arguments of `cargo install` into the keg.
  def std_cargo_args(path: ".", root: prefix)
    ["--locked", "--root=#{root}", "--path=#{path}"]
  end

  # In `install`, `system` is recorded and `cargo install` stands in for by copying the binary
  # already built; in `test do` it runs the command and fails on a non-zero exit.
  def system(cmd, *args)
    cmd = cmd.to_s
    args = args.map(&:to_s)
    if @phase == :install
      @calls << [cmd, *args]
      return true unless cmd == "cargo" && args.first == "install"

      path = args.find { |a| a.start_with?("--path=") }&.delete_prefix("--path=")
      check(path && File.file?(File.join(path, "Cargo.toml")), "cargo install --path=#{path}: not a crate directory")
      FileUtils.mkdir_p(bin)
      FileUtils.cp(ENV.fetch("AGENTMBX_CHECK_BINARY"), bin/"agentmbx")
      return true
    end
    out, status = Open3.capture2e(cmd, *args)
    check(status.success?, "system #{([cmd] + args).join(" ")} exited #{status.exitstatus}: #{out}")
    true
  end

  # Homebrew's generate_completions_from_executable with its default shells and no
  # shell_parameter_format: runs `<executable> <args...> <shell>` for bash, zsh and fish.
  def generate_completions_from_executable(*commands, shells: [:bash, :zsh, :fish], shell_parameter_format: nil)
    check(shell_parameter_format.nil?, "this stand-in only knows the default shell_parameter_format")
    targets = { bash: bash_completion/"agentmbx", zsh: zsh_completion/"_agentmbx", fish: fish_completion/"agentmbx.fish" }
    shells.each do |shell|
      out, status = Open3.capture2(*commands.map(&:to_s), shell.to_s)
      check(status.success? && !out.empty?, "#{commands.join(" ")} #{shell}: no completion script")
      FileUtils.mkdir_p(targets.fetch(shell).dirname)
      targets.fetch(shell).write(out)
    end
  end

  def shell_output(cmd, result = 0)
    out, status = Open3.capture2("/bin/sh", "-c", cmd)
    check(status.exitstatus == result, "shell_output(#{cmd.inspect}) exited #{status.exitstatus}, want #{result}: #{out}")
    out
  end

  def assert_match(expected, actual)
    ok = expected.is_a?(Regexp) ? expected.match?(actual) : actual.include?(expected)
    check(ok, "assert_match: #{expected.inspect} not in #{actual.inspect}")
  end

  def assert_equal(expected, actual)
    check(expected == actual, "assert_equal: want #{expected.inspect}, got #{actual.inspect}")
  end

  def assert_predicate(object, predicate)
    check(object.send(predicate), "assert_predicate: #{object.inspect} is not #{predicate}")
  end

  def run_phase(phase, &block)
    @phase = phase
    instance_eval(&block)
  ensure
    @phase = nil
  end
end

# Pathname#install as Homebrew defines it: copy files into the directory, creating it.
class Pathname
  def install(*sources)
    mkpath
    sources.flatten.each { |src| FileUtils.cp(src, self/File.basename(src.to_s)) }
  end
end

# Homebrew's ENV takes a Pathname as a value (formulae write `ENV["HOME"] = testpath`).
ENV.singleton_class.prepend(Module.new do
  def []=(key, value)
    super(key, value.is_a?(Pathname) ? value.to_s : value)
  end
end)

formula_path, binary = ARGV
abort "usage: ruby #{$PROGRAM_NAME} <formula.rb> <agentmbx binary>" unless formula_path && binary && File.executable?(binary)
ENV["AGENTMBX_CHECK_BINARY"] = File.expand_path(binary)
repo = File.expand_path("../..", __dir__)

begin
  load File.expand_path(formula_path)
  classes = Formula.subclasses_seen || []
  check(classes.size == 1, "the formula file defines #{classes.size} Formula subclasses, want 1")
  klass = classes.first
  check(klass.name == "Agentmbx", "class #{klass.name}: Homebrew expects Agentmbx for agentmbx.rb")
  [:desc, :homepage, :url, :sha256, :license].each { |key| check(klass.spec.key?(key), "missing #{key}") }
  check(klass.spec[:depends_on].include?({ "rust" => :build }), "depends_on \"rust\" => :build missing")
  check(klass.instance_methods(false).include?(:install), "no install method")
  check(klass.service_block, "no service do block")
  check(klass.test_block, "no test do block")

  Dir.mktmpdir("agentmbx-brew") do |tmp|
    f = klass.new("#{tmp}/Cellar/agentmbx", "#{tmp}/testpath")
    Dir.chdir(repo) { f.run_phase(:install) { install } }
    cargo = f.calls.find { |c| c[0, 2] == ["cargo", "install"] }
    check(cargo, "install does not run cargo install")
    check(cargo.include?("--locked") && cargo.include?("--path=daemon"), "cargo install is not std_cargo_args(path: \"daemon\"): #{cargo.inspect}")
    pages = Dir[File.join(repo, "man/*.1")].map { |p| File.basename(p) }.sort
    installed = Dir[(f.man1/"*.1").to_s].map { |p| File.basename(p) }.sort
    check(!pages.empty? && installed == pages, "man1 holds #{installed.size} pages, man/ has #{pages.size}")
    [f.bash_completion/"agentmbx", f.zsh_completion/"_agentmbx", f.fish_completion/"agentmbx.fish"].each do |c|
      check(c.file?, "no completion script #{c}")
    end

    svc = StubService.new(f, &klass.service_block)
    check(svc.run_args == [(f.opt_bin/"agentmbx").to_s, "daemon"], "service run: #{svc.run_args.inspect}, want [opt_bin/\"agentmbx\", \"daemon\"]")
    check(svc.keep_alive_value, "service: no keep_alive (the daemon is not restarted when it fails)")
    check(svc.paths[:log_path], "service: no log_path")

    f.testpath.mkpath
    saved = ENV.to_h
    begin
      ENV["HOME"] = f.testpath.to_s
      Dir.chdir(f.testpath) { f.run_phase(:test, &klass.test_block) }
    ensure
      ENV.replace(saved)
    end
    puts "formula loads, install puts #{installed.size} man pages and 3 completions in place, service runs " \
         "#{svc.run_args.map { |a| File.basename(a) }.join(" ")}, test do passes"
  end
rescue CheckFailure, NoMethodError, NameError, ArgumentError, TypeError => e
  warn "#{formula_path}: #{e.class}: #{e.message}"
  warn e.backtrace.grep(/#{Regexp.escape(File.basename(formula_path))}/).first(3).join("\n")
  exit 1
end
