// The floor of a shared-memory hand-off on this host: two processes pinned to CPUs 0 and 1
// pass one atomic word back and forth 10^6 times. gcc -O2 scripts/cacheline-pingpong.c -o /tmp/pp && /tmp/pp
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#include <stdatomic.h>
#include <sys/wait.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(){
  _Atomic long *a = mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  _Atomic long *b = a+16;
  int N=1000000;
  if(fork()==0){cpu_set_t s;CPU_ZERO(&s);CPU_SET(1,&s);sched_setaffinity(0,sizeof s,&s);
    for(long i=1;i<=N;i++){while(atomic_load_explicit(a,memory_order_acquire)!=i);atomic_store_explicit(b,i,memory_order_release);}exit(0);}
  cpu_set_t s;CPU_ZERO(&s);CPU_SET(0,&s);sched_setaffinity(0,sizeof s,&s);
  double t0=now();
  for(long i=1;i<=N;i++){atomic_store_explicit(a,i,memory_order_release);while(atomic_load_explicit(b,memory_order_acquire)!=i);}
  double t1=now(); wait(0);
  printf("round trip %.1f ns\n",(t1-t0)/N);
}
