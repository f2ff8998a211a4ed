/* PID 1 of the emulated guest (scripts/amx-emu/run.sh): runs cachet-kernels' AMX tests,
 * prints "=== exit status: N" after each, then powers off. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <sys/reboot.h>
#include <termios.h>
static void run(char *const argv[]) {
  printf("=== run: %s %s %s %s\n", argv[0], argv[1] ? argv[1] : "", argv[1] && argv[2] ? argv[2] : "", argv[1] && argv[2] && argv[3] ? argv[3] : ""); fflush(stdout);
  pid_t p = fork();
  if (p == 0) { execv(argv[0], argv); perror("execv"); _exit(127); }
  int st = 0; waitpid(p, &st, 0);
  printf("=== exit status: %d (signal %d)\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0); fflush(stdout);
}
int main(void) {
  mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
  mount("proc", "/proc", "proc", 0, NULL);
  int fd = open("/dev/ttyS0", O_RDWR);
  if (fd >= 0) { dup2(fd, 0); dup2(fd, 1); dup2(fd, 2); }
  setenv("RUST_BACKTRACE", "1", 1);
  printf("=== init up\n"); fflush(stdout);
  FILE *f = fopen("/proc/cpuinfo", "r"); char line[4096];
  while (f && fgets(line, sizeof line, f)) { if (!strncmp(line, "model name", 10) || !strncmp(line, "flags", 5)) fputs(line, stdout); }
  if (f) fclose(f);
  char *a1[] = {"/bin/lib", "amx", "--test-threads=1", "--nocapture", NULL}; run(a1);
  char *a2[] = {"/bin/correctness", "amx_level", "--test-threads=1", "--nocapture", NULL}; run(a2);
  char *a3[] = {"/bin/correctness", "matmul", "--test-threads=1", NULL}; run(a3);
  char *a4[] = {"/bin/correctness", "isa_levels_agree", "--test-threads=1", NULL}; run(a4);
  printf("=== done\n"); fflush(stdout);
  fflush(stdout); tcdrain(1); sleep(3); sync(); reboot(RB_POWER_OFF);
  for (;;) pause();
}
